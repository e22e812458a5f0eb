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

{{- define "atoll.image" -}}
{{- $img := .image | default dict -}}
{{- $repo := $img.repository | default .root.Values.image.repository -}}
{{- $tag := $img.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "atoll.tokenSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "atoll.fullname" .)) -}}
{{- end -}}

{{- define "atoll.redisSecret" -}}
{{- .Values.redis.existingSecret | default (printf "%s-redis" (include "atoll.fullname" .)) -}}
{{- end -}}

{{- define "atoll.hasRedisPassword" -}}
{{- if or .Values.redis.existingSecret .Values.redis.password -}}true{{- end -}}
{{- end -}}

{{- define "atoll.hasToken" -}}
{{- if or .Values.auth.existingSecret .Values.auth.token -}}true{{- end -}}
{{- end -}}

{{/* The Redis URL the synchronizers use; $(REDIS_PASSWORD) is expanded by Kubernetes. */}}
{{- define "atoll.redisURL" -}}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (eq (include "atoll.hasRedisPassword" .) "true") -}}
{{- if .Values.redis.url -}}
{{- $url := .Values.redis.url -}}
{{- if $auth -}}
{{- regexReplaceAll "^(rediss?://)" $url (printf "${1}%s" $auth) -}}
{{- else -}}
{{- $url -}}
{{- end -}}
{{- else -}}
{{- printf "redis://%s%s-redis:6379/0" $auth (include "atoll.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "atoll.synchronizerAddress" -}}
{{- printf "dns:///%s-synchronizer-headless.%s.svc:%d" (include "atoll.fullname" .) .Release.Namespace (int .Values.synchronizer.grpcPort) -}}
{{- end -}}
