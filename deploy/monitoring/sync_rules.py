"""Copy alerts.rules.yml to where the Prometheus Operator objects take it from.

    python3 deploy/monitoring/sync_rules.py

alerts.rules.yml is the one source; deploy/components/prometheusrule/prometheusrule.yaml
(kustomize) carries its groups under ``spec:``, and the chart reads a copy from
deploy/helm/worker/files/ (a chart cannot read files outside its directory). The tests
fail when either copy differs from the source.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent
SOURCE = HERE / "alerts.rules.yml"
COMPONENT = DEPLOY / "components" / "prometheusrule" / "prometheusrule.yaml"
CHART_COPY = DEPLOY / "helm" / "worker" / "files" / "alerts.rules.yml"

HEADER = """\
# Generated from deploy/monitoring/alerts.rules.yml (its groups, indented under spec:):
# the tests fail when the two differ. After changing the rules:
#   python3 deploy/monitoring/sync_rules.py
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: worker
  labels:
    app.kubernetes.io/name: worker
spec:
"""


def component_text(source: str) -> str:
    groups = source[source.index("groups:") :]
    indented = "".join(f"  {line}" if line.strip() else line for line in groups.splitlines(True))
    return HEADER + indented


def main() -> None:
    source = SOURCE.read_text()
    COMPONENT.write_text(component_text(source))
    CHART_COPY.write_text(source)


if __name__ == "__main__":
    main()
