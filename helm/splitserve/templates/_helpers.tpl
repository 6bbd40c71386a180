{{/*
Names and labels shared by every template of the splitserve chart.
*/}}

{{/* splitserve.name is the chart name, or nameOverride. */}}
{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* splitserve.fullname is <release>-<chart> (or fullnameOverride), kept short enough for
the "-router" suffix and Lease names. */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* splitserve.chart is name-version for the helm.sh/chart label. */}}
{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* splitserve.labels are the standard labels of every object. */}}
{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" . }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end -}}

{{/* splitserve.selectorLabels select the operator pods (immutable once installed). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* splitserve.serviceAccountName is the operator's ServiceAccount. */}}
{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* splitserve.routerServiceAccountName is the ServiceAccount of router pods. */}}
{{- define "splitserve.routerServiceAccountName" -}}
{{- default (printf "%s-router" (include "splitserve.fullname" .)) .Values.router.serviceAccountName -}}
{{- end -}}

{{/* splitserve.watchNamespace is the single watched namespace (namespace scope) or "". */}}
{{- define "splitserve.watchNamespace" -}}
{{- if eq .Values.rbac.scope "namespace" -}}
{{- default .Release.Namespace .Values.watchNamespace -}}
{{- end -}}
{{- end -}}

{{/* splitserve.routerNamespaces is a JSON list of the namespaces that get router RBAC. */}}
{{- define "splitserve.routerNamespaces" -}}
{{- if .Values.router.namespaces -}}
{{- toJson .Values.router.namespaces -}}
{{- else -}}
{{- list (default .Release.Namespace (include "splitserve.watchNamespace" .)) | toJson -}}
{{- end -}}
{{- end -}}

{{/* splitserve.leaseName is the leader election Lease. */}}
{{- define "splitserve.leaseName" -}}
{{- default (include "splitserve.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* splitserve.image is the operator image reference (digest wins over tag). */}}
{{- define "splitserve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* splitserve.operatorRules are the RBAC rules of the operator in the watched
namespace(s): explicit verbs, no wildcards, and Secrets create-only (never read). */}}
{{- define "splitserve.operatorRules" -}}
- apiGroups: ["splitserve.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["splitserve.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["splitserve.dev"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
# Multi-node pools (resources.gpusPerNode): a LeaderWorkerSet each, server-side applied (a patch
# that may create it) by the reconciler and, for spec.replicas (its groups), the autoscaler;
# read, never watched (the LWS CRD may be absent). Its scale and status are read only.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["create", "get", "patch"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets/scale", "leaderworkersets/status"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
# Pods: status for readiness, and the pod-deletion-cost annotation before a scale-down.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# The KV handoff key Secret of each disaggregated InferenceService is created once; a create
# that finds it already there is the answer. No get/list/watch: the operator never reads a
# Secret (it references the others in pod specs, for the kubelet to read).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
