{{/* Names, labels and RBAC rules shared by the templates. */}}

{{- define "refit-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; the release name alone when it already contains the chart's. */}}
{{- define "refit-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "refit-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "refit-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "refit-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "refit-operator.labels" -}}
helm.sh/chart: {{ include "refit-operator.chart" . }}
{{ include "refit-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "refit-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "refit-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "refit-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Rights on namespaced resources: the RefitJobs, their children, Events, and the per-job
ServiceAccount/Role/RoleBinding. The operator creates Roles that grant get/watch/patch on
ConfigMaps, so it must hold those verbs itself (Kubernetes refuses RBAC escalation).
*/}}
{{- define "refit-operator.namespacedRules" -}}
- apiGroups: ["refit.dev"]
  resources: ["refitjobs"]
  {{- /* delete: a finished job whose ttlSecondsAfterFinished ran out */}}
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["refit.dev"]
  resources: ["refitjobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["pods", "services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- /* A gang's PodGroup (gang.admission: PodGroup) for Volcano or coscheduling. */}}
- apiGroups: ["scheduling.volcano.sh", "scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* kopf discovers its resources through the CRDs; peering is off, so no kopfpeerings. */}}
{{- define "refit-operator.crdRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- end }}
