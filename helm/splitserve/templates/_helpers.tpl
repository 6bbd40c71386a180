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

{{/* splitserve.watchNamespaces is a JSON list of the watched namespaces, each getting the
operator's Role and RoleBinding: watchNamespace (default the release namespace) in namespace
scope, watchNamespaces in namespaces scope, [] (every namespace, a ClusterRole) in cluster
scope. */}}
{{- define "splitserve.watchNamespaces" -}}
{{- if eq .Values.rbac.scope "namespaces" -}}
{{- .Values.watchNamespaces | uniq | toJson -}}
{{- else if eq .Values.rbac.scope "namespace" -}}
{{- list (default .Release.Namespace .Values.watchNamespace) | toJson -}}
{{- else -}}
{{- list | toJson -}}
{{- end -}}
{{- end -}}

{{/* splitserve.routerNamespaces is a JSON list of the namespaces that get router RBAC. */}}
{{- define "splitserve.routerNamespaces" -}}
{{- if .Values.router.namespaces -}}
{{- toJson .Values.router.namespaces -}}
{{- else if ne .Values.rbac.scope "cluster" -}}
{{- include "splitserve.watchNamespaces" . -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
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

{{/* splitserve.inferencePoolRules are the operator's extra RBAC rules for spec.router.mode
InferencePool (inferencePool.enabled): the InferencePool and its endpoint picker's
ServiceAccount, Role and RoleBinding. No escalate or bind: the picker's Role grants only reads
the operator holds itself (pods, the InferencePool, and InferenceObjectives, read for that
reason alone). Creating ServiceAccounts, Roles and RoleBindings lets the operator hand what it
holds to any subject, hence off by default. Without it the operator still reads the three (its
child watch lists them in every mode) but never writes one. */}}
{{- define "splitserve.inferencePoolRules" -}}
{{- if .Values.inferencePool.enabled -}}
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["inference.networking.x-k8s.io"]
  resources: ["inferenceobjectives"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
{{- else -}}
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch"]
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
# The KV handoff key Secret of each disaggregated InferenceService is created once. list and
# watch, with the operator's label and metadata only (no Secret's data is ever requested):
# a Secret of that name the InferenceService does not own is a NameConflict, and a deleted
# one is created again at once. No get: the operator asks for no Secret's data (it references
# the others in pod specs, for the kubelet to read).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
