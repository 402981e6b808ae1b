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
Rights on namespaced resources: exactly the verbs the operator uses (refit_operator.shell.kube.VERBS;
tests/integration/test_chart_rbac.py checks both ways). Every write is a merge patch, never
an update; no child but a pod or PodGroup is ever deleted (the rest go with their job).
*/}}
{{- define "refit-operator.namespacedRules" -}}
- apiGroups: ["refit.dev"]
  resources: ["refitjobs"]
  {{- /* watch, list, patch: kopf (its annotations); get: each round; delete: a finished
         job whose ttlSecondsAfterFinished ran out */}}
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["refit.dev"]
  resources: ["refitjobs/status"]
  verbs: ["patch"]
{{- /* patch: the gang's scheduling gates; delete: restarts and replacements. */}}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete", "patch"]
{{- /* patch: the operator's rendezvous keys; get: the workers' Roles grant it, and
       Kubernetes refuses to let an account grant what it does not hold. */}}
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- /* Created once, listed (by the job's label) each round; never read by name,
       changed or deleted (they go with their job). The signing key's Secret too: whoever
       may create pods here can read Secrets through them anyway (docs/security.md). */}}
- apiGroups: [""]
  resources: ["services", "secrets", "serviceaccounts"]
  verbs: ["list", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "create"]
{{- /* patch: a repeated Event updates its series. */}}
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- /* A gang's PodGroup (gang.admission: PodGroup) for Volcano or coscheduling: created
       and deleted with its gang, never read. */}}
- apiGroups: ["scheduling.volcano.sh", "scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "delete"]
{{- end }}
