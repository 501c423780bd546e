{{/* Names and labels shared by every object of a release. */}}
{{- define "pergola.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pergola.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: triton or gateway. */}}
{{- define "pergola.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pergola.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The headless Service whose DNS name answers with every ready Triton pod's address. */}}
{{- define "pergola.tritonService" -}}
{{ include "pergola.fullname" . }}-triton
{{- end -}}

{{/* The gateway's API keys, when a Secret holds them. Never given to the Triton pods: Triton takes
keys only on its command line, readable in the process list, and `pergola serve` refuses them with
its ports open to other hosts; the NetworkPolicy (networkPolicy.enabled) keeps other pods off them. */}}
{{- define "pergola.keysEnv" -}}
{{- if .Values.apiKeys.existingSecret -}}
- name: PERGOLA_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- end -}}
