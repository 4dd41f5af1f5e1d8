{{/* The chart's name: app.kubernetes.io/name. */}}
{{- define "worker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's objects: <release>-<name>, or the release name if it has the name in it. */}}
{{- define "worker.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A name with a suffix that still fits 63 characters. */}}
{{- define "worker.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "worker.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- end -}}

{{/* What selects this release's pods: never another install's, in any namespace. */}}
{{- define "worker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "worker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "worker.labels" -}}
{{ include "worker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: idempotent-worker
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "worker.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "worker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "worker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret every pod reads WORKER_DATABASE_URL (and the broker's credentials) from. */}}
{{- define "worker.secretName" -}}
{{- if .Values.secrets.externalSecret.enabled -}}
{{- include "worker.suffixed" (list . "secrets") -}}
{{- else if .Values.secrets.existingSecret -}}
{{- .Values.secrets.existingSecret -}}
{{- else -}}
{{- fail "secrets: set secrets.existingSecret (a Secret with WORKER_DATABASE_URL and the broker's keys) or secrets.externalSecret.enabled" -}}
{{- end -}}
{{- end -}}

{{/* The ConfigMap's data: the common settings, the broker's, WORKER_BROKER and the ops port. */}}
{{- define "worker.config" -}}
{{- $broker := index .Values .Values.broker -}}
{{- $config := merge (dict "WORKER_BROKER" .Values.broker "WORKER_OPS_PORT" (toString .Values.opsPort) "WORKER_OPS_HOST" "0.0.0.0") $broker.config .Values.config -}}
{{- if hasKey $config "WORKER_DATABASE_URL" -}}
{{- fail "config: WORKER_DATABASE_URL is a secret; put it in the Secret (secrets.existingSecret), not in config" -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Connections one pod may hold: every engine it opens (docs/operations.md, "Connection budget"). */}}
{{- define "worker.connectionsPerPod" -}}
{{- $config := include "worker.config" . | fromYaml -}}
{{- $concurrency := int (default "16" (get $config "WORKER_CONCURRENCY")) -}}
{{- $pool := int (default (toString (add $concurrency 2)) (get $config "WORKER_DB_POOL_SIZE")) -}}
{{- $overflow := int (default "2" (get $config "WORKER_DB_MAX_OVERFLOW")) -}}
{{- $monitor := 1 -}}
{{- $offsets := 0 -}}
{{- if and (eq .Values.broker "kafka") (or (eq (get $config "WORKER_KAFKA_OFFSETS") "database") (ne (default "database" (get $config "WORKER_DELIVERY_COUNTS")) "broker")) -}}
{{- $offsets = 4 -}}
{{- end -}}
{{- add $pool $overflow $monitor $offsets -}}
{{- end -}}

{{- define "worker.maxSurge" -}}
{{- if eq .Values.broker "kafka" -}}0{{- else -}}1{{- end -}}
{{- end -}}

{{/* Fails the render when the fleet at its largest would not fit the database. */}}
{{- define "worker.checkBudget" -}}
{{- $pods := add .Values.autoscaling.maxReplicas (int (include "worker.maxSurge" .)) -}}
{{- $perPod := int (include "worker.connectionsPerPod" .) -}}
{{- $needed := add (mul $pods $perPod) .Values.database.otherClients -}}
{{- $available := sub .Values.database.maxConnections .Values.database.reservedConnections -}}
{{- if gt (int $needed) (int $available) -}}
{{- fail (printf "connection budget: %d pods x %d connections + %d others = %d > %d (database.maxConnections %d - reservedConnections %d): lower autoscaling.maxReplicas, WORKER_CONCURRENCY or WORKER_DB_POOL_SIZE, or raise database.maxConnections" (int $pods) $perPod (int .Values.database.otherClients) (int $needed) (int $available) (int .Values.database.maxConnections) (int .Values.database.reservedConnections)) -}}
{{- end -}}
{{- end -}}

{{/* The environment every container of the release gets: the database URL from the Secret. */}}
{{- define "worker.databaseEnv" -}}
- name: WORKER_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "worker.secretName" .root }}
      key: {{ .key }}
{{- end -}}

{{- define "worker.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "worker.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}
