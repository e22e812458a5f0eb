{{/* Names and labels shared by every template. */}}
{{- define "atoll.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "atoll.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "atoll.labels" -}}
app.kubernetes.io/name: {{ include "atoll.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: atoll
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "atoll.selector" -}}
app.kubernetes.io/name: {{ include "atoll.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* repository@digest when a digest is set, else repository:tag. A pool that names its own
repository or tag does not inherit the release's digest. */}}
{{- define "atoll.image" -}}
{{- $img := .image | default dict -}}
{{- $g := .root.Values.image -}}
{{- $repo := $img.repository | default $g.repository -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $repo $img.digest -}}
{{- else if or $img.repository $img.tag -}}
{{- printf "%s:%s" $repo ($img.tag | default $g.tag | default .root.Chart.AppVersion) -}}
{{- else if $g.digest -}}
{{- printf "%s@%s" $repo $g.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo ($g.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "atoll.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "atoll.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "atoll.tokenSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "atoll.fullname" .)) -}}
{{- end -}}

{{- define "atoll.redisSecret" -}}
{{- .Values.redis.existingSecret | default (printf "%s-redis" (include "atoll.fullname" .)) -}}
{{- end -}}

{{/* A password: an existing Secret, one given in values, or one generated for the bundled
Redis. */}}
{{- define "atoll.hasRedisPassword" -}}
{{- if or .Values.redis.existingSecret .Values.redis.password (include "atoll.bundledRedis" .) -}}true{{- end -}}
{{- end -}}

{{- define "atoll.bundledRedis" -}}
{{- if and .Values.redis.bundled.enabled (not .Values.redis.url) -}}true{{- end -}}
{{- end -}}

{{- define "atoll.hasToken" -}}
{{- if or .Values.auth.existingSecret .Values.auth.token -}}true{{- end -}}
{{- end -}}

{{/* The Redis URL the synchronizers use. It never holds the password: that is a file
(ATOLL_REDIS_PASSWORD_FILE), so it shows in no argument list, URL or log line. */}}
{{- define "atoll.redisURL" -}}
{{- .Values.redis.url | default (printf "redis://%s-redis:6379/0" (include "atoll.fullname" .)) -}}
{{- end -}}

{{- define "atoll.synchronizerAddress" -}}
{{- printf "dns:///%s-synchronizer-headless.%s.svc:%d" (include "atoll.fullname" .) .Release.Namespace (int .Values.synchronizer.grpcPort) -}}
{{- end -}}


{{/* Pod metadata: the component's fixed labels (.labels, which selectors rely on, so they
win) over its own and the release's podLabels; its own and the release's annotations. */}}
{{- define "atoll.podMetadata" -}}
labels:
  {{- toYaml (merge (dict) .labels (.spec.podLabels | default dict) .root.Values.podLabels) | nindent 2 }}
{{- with merge (dict) (.spec.podAnnotations | default dict) .root.Values.podAnnotations (.annotations | default dict) }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* What every pod spec shares: service account, pull secrets, priority and placement.
.spec is the component's values; .selector its pods' labels (the default labelSelector of
a topology spread constraint); .nodeSelector and .affinity the chart's own defaults. */}}
{{- define "atoll.podPlacement" -}}
{{- $ctx := . -}}
{{- $root := .root -}}
serviceAccountName: {{ include "atoll.serviceAccountName" $root }}
automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.priorityClassName | default $root.Values.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with merge (dict) (.nodeSelector | default dict) (.spec.nodeSelector | default dict) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity | default .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  - {{- toYaml (merge (dict) . (dict "labelSelector" (dict "matchLabels" $ctx.selector))) | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Every container: no privilege, no capability, a read-only root (writable paths are
volumes). */}}
{{- define "atoll.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{- define "atoll.tlsVolume" -}}
- name: tls
  secret: {secretName: {{ .secret }}, defaultMode: 0440}
{{- end -}}

{{/* The labels every atoll series carries, whatever the Prometheus: `job` as the alert rules
and dashboards name a role's targets (atoll-synchronizer, atoll-learner), `atoll_job` (the
training job, which the rules group by and the dashboard's `job` variable selects), `slot`
(the pod's name: stable across a learner's restarts, as a StatefulSet keeps it) and
`region`. Called with (dict "job" ROLE-JOB "atollJob" .Values.job.name). */}}
{{- define "atoll.scrapeLabels" -}}
- targetLabel: job
  replacement: {{ .job }}
- targetLabel: atoll_job
  replacement: {{ .atollJob | quote }}
- sourceLabels: [__meta_kubernetes_pod_name]
  targetLabel: slot
- sourceLabels: [__meta_kubernetes_pod_label_atoll_dev_region]
  targetLabel: region
{{- end -}}


{{/* A Prometheus without the operator finds the pods by these (monitoring.scrapeAnnotations).
Called with (dict "root" $ "port" METRICS-PORT). */}}
{{- define "atoll.scrapeAnnotations" -}}
{{- if .root.Values.monitoring.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
