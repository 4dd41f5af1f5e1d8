"""Render dashboard.json as a static HTML page from a live Prometheus, for a picture of it.

Every panel's queries are evaluated by a real Prometheus (query_range, the last
``--minutes``); only the drawing is this script's, not Grafana's. Then, for a PNG:

    python3 deploy/monitoring/render_preview.py --prometheus http://127.0.0.1:9090 \\
        --out preview.html
    chromium --headless --no-sandbox --hide-scrollbars --window-size=1570,2650 \\
        --screenshot=dashboard-preview.png preview.html
"""

from __future__ import annotations

import argparse
import html
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("dashboard.json")
ROW_HEIGHT = 34  # pixels per grid unit of height
GAP = 6
COLORS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a"]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[Any]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with _OPENER.open(f"{base}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    result: list[Any] = body["data"]["result"]
    return result


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template) or "value"


def fmt(value: float, unit: str) -> str:
    if unit == "s":
        if value >= 3600:
            return f"{value / 3600:.1f} h"
        if value >= 60:
            return f"{value / 60:.1f} min"
        return f"{value:.3g} s" if value >= 0.001 else f"{value * 1000:.2g} ms"
    if unit == "ops":
        return f"{value:.3g}/s"
    return f"{value:.4g}"


def series_of(panel: dict[str, Any], base: str, start: float, end: float, step: float) -> list[Any]:
    found = []
    for target in panel.get("targets", []):
        expr = target["expr"].replace("$__rate_interval", "1m")
        for item in query_range(base, expr, start, end, step):
            points = [(float(t), float(v)) for t, v in item["values"] if v not in ("NaN", "+Inf")]
            if points:
                found.append((legend(target.get("legendFormat", ""), item["metric"]), points))
    return found


def svg_chart(
    series: list[Any], unit: str, width: int, height: int, span: tuple[float, float]
) -> str:
    if not series:
        return '<div class="empty">No data</div>'
    values = [v for _, points in series for _, v in points]
    top = max(values) * 1.1 or 1.0
    left, right = span
    pad = 46

    def x(t: float) -> float:
        return pad + (t - left) / max(right - left, 1) * (width - pad - 8)

    def y(v: float) -> float:
        return 8 + (1 - v / top) * (height - 24)

    parts = [f'<svg width="{width}" height="{height}">']
    for i in range(5):
        level = top * i / 4
        parts.append(
            f'<line x1="{pad}" x2="{width - 8}" y1="{y(level):.1f}" y2="{y(level):.1f}" '
            f'class="grid"/><text x="{pad - 4}" y="{y(level) + 4:.1f}" class="axis">'
            f"{html.escape(fmt(level, unit))}</text>"
        )
    for i, (_, points) in enumerate(series):
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
        parts.append(f'<polyline points="{path}" stroke="{COLORS[i % len(COLORS)]}" class="line"/>')
    parts.append("</svg>")
    return "".join(parts)


def render(base: str, minutes: float) -> str:
    spec = json.loads(DASHBOARD.read_text())
    end = time.time()
    start, step = end - minutes * 60, max(5.0, minutes * 60 / 200)
    cells = []
    for panel in spec["panels"]:
        grid = panel["gridPos"]
        style = (
            f"grid-column: {grid['x'] + 1} / span {grid['w']}; "
            f"grid-row: {grid['y'] + 1} / span {grid['h']};"
        )
        title = html.escape(panel["title"])
        if panel["type"] == "row":
            cells.append(f'<div class="row" style="{style}">{title}</div>')
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        series = series_of(panel, base, start, end, step)
        width = grid["w"] * 64 - 16
        height = grid["h"] * (ROW_HEIGHT + GAP) - GAP - 40
        if panel["type"] == "stat":
            mappings = panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", [])
            texts = {k: v["text"] for m in mappings for k, v in m.get("options", {}).items()}
            shown = [
                (name, texts.get(f"{points[-1][1]:g}", fmt(points[-1][1], unit)))
                for name, points in series
            ]
            body = (
                "".join(
                    f'<div class="stat"><b>{html.escape(v)}</b><span>{html.escape(n)}</span></div>'
                    for n, v in shown
                )
                or '<div class="empty">No data</div>'
            )
        else:
            keys = "".join(
                f'<span><i style="background:{COLORS[i % len(COLORS)]}"></i>'
                f"{html.escape(name)}: {html.escape(fmt(points[-1][1], unit))}</span>"
                for i, (name, points) in enumerate(series)
            )
            chart = svg_chart(series, unit, width, height - 22, (start, end))
            body = f'{chart}<div class="legend">{keys}</div>'
        cells.append(f'<div class="panel" style="{style}"><h3>{title}</h3>{body}</div>')
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(end))
    return f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ background: #111217; color: #ccccdc; font: 13px sans-serif; margin: 16px; width: 1536px; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }} .note {{ color: #8e8e9e; margin-bottom: 12px; }}
.grid {{ display: grid; grid-template-columns: repeat(24, 1fr); grid-auto-rows: {ROW_HEIGHT}px;
  gap: {GAP}px; }}
.panel {{ background: #181b1f; border: 1px solid #2c3235; border-radius: 3px; padding: 6px 8px;
  overflow: hidden; }}
.panel h3 {{ margin: 0 0 4px; font-size: 13px; font-weight: 500; }}
.row {{ font-size: 16px; font-weight: 500; align-self: end; border-bottom: 1px solid #2c3235; }}
svg .grid {{ stroke: #2c3235; }} svg .axis {{ fill: #8e8e9e; font-size: 10px; text-anchor: end; }}
svg .line {{ fill: none; stroke-width: 1.6; }}
.legend span {{ margin-right: 12px; font-size: 11px; white-space: nowrap; }}
.legend i {{ display: inline-block; width: 10px; height: 3px; margin-right: 4px;
  vertical-align: middle; }}
.stat {{ display: inline-block; margin-right: 24px; }}
.stat b {{ display: block; font-size: 30px; color: #73bf69; }}
.stat span {{ color: #8e8e9e; }} .empty {{ color: #6e6e7e; padding: 20px; }}
</style></head><body><h1>{html.escape(spec["title"])}</h1>
<div class="note">A static rendering of dashboard.json: each panel's queries evaluated by
Prometheus over the {minutes:g} minutes before {stamp}, while it scraped one real worker
(RabbitMQ, PostgreSQL, generated traffic). Drawn by render_preview.py, not by Grafana.</div>
<div class="grid">{"".join(cells)}</div></body></html>
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("preview.html"))
    args = parser.parse_args()
    args.out.write_text(render(args.prometheus.rstrip("/"), args.minutes))


if __name__ == "__main__":
    main()
