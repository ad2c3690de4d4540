{{/*
Names, labels, images and the pieces every Apogee pod shares.
A component is one of: nameserver, broker, schedule, txn-checker (and test, operator).
*/}}

{{- define "apogee.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or the release name when it contains the chart name. */}}
{{- define "apogee.fullname" -}}
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

{{/* The name of a component's objects: (dict "root" $ "component" "broker"). */}}
{{- define "apogee.componentName" -}}
{{- printf "%s-%s" (include "apogee.fullname" .root) .component -}}
{{- end -}}

{{- define "apogee.labels" -}}
app.kubernetes.io/name: {{ include "apogee.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: apogee
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: stable over upgrades, never the chart version. */}}
{{- define "apogee.selectorLabels" -}}
app.kubernetes.io/name: {{ include "apogee.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
An object's metadata: (dict "root" $ "component" "broker"), with optional "name" (default: the
component's name), "namespace", "labels" and "annotations" (added to the common ones).
*/}}
{{- define "apogee.metadata" -}}
name: {{ .name | default (include "apogee.componentName" .) }}
namespace: {{ .namespace | default .root.Release.Namespace }}
labels:
  {{- include "apogee.labels" . | nindent 2 }}
  {{- with .labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- $annotations := merge (dict) (.annotations | default dict) .root.Values.commonAnnotations }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The label that lets a pod of this namespace reach nameservers and brokers. */}}
{{- define "apogee.clientLabel" -}}
{{- printf "%s-client" (include "apogee.fullname" .) -}}
{{- end -}}

{{/* An image reference: (dict "root" $ "image" .Values.broker.image). */}}
{{- define "apogee.image" -}}
{{- $registry := .root.Values.image.registry -}}
{{- $repository := .image.repository -}}
{{- if $registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" $registry) $repository -}}
{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (.image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* The image with the `apogee` command (the tools image apogee/cli): tests.image. */}}
{{- define "apogee.cliImage" -}}
{{- include "apogee.image" (dict "root" . "image" .Values.tests.image) -}}
{{- end -}}

{{/* The DNS domain of the release's namespace: <namespace>.svc.<clusterDomain>. */}}
{{- define "apogee.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* Every nameserver, host:port separated by ';', by their stable DNS names. */}}
{{- define "apogee.namesrv" -}}
{{- $service := include "apogee.componentName" (dict "root" . "component" "nameserver") -}}
{{- $domain := include "apogee.svcDomain" . -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.nameserver.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s:%d" $service $i $service $domain (int $.Values.nameserver.ports.grpc)) -}}
{{- end -}}
{{- join ";" $addresses -}}
{{- end -}}

{{/* A broker's advertised address; $(POD_NAME) is the pod's name (downward API). */}}
{{- define "apogee.brokerAdvertisedAddress" -}}
{{- $service := include "apogee.componentName" (dict "root" . "component" "broker") -}}
{{- printf "$(POD_NAME).%s.%s:%d" $service (include "apogee.svcDomain" .) (int .Values.broker.ports.grpc) -}}
{{- end -}}

{{/* The service account of the schedule and txn-checker pods. */}}
{{- define "apogee.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "apogee.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* settings map -> APOGEE_<PREFIX>_<NAME> variables: (dict "prefix" "BROKER" "settings" ...). */}}
{{- define "apogee.settingsEnv" -}}
{{- $env := list -}}
{{- range $name, $value := .settings -}}
{{- $text := toString $value -}}
{{- /* values' numbers are floats: 1073741824 would read 1.073741824e+09 */ -}}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) -}}
{{- $text = printf "%d" (int64 $value) -}}
{{- end -}}
{{- $env = append $env (dict "name" (printf "APOGEE_%s_%s" $.prefix (upper $name)) "value" $text) -}}
{{- end -}}
{{- if $env }}{{ toYaml $env }}{{ end -}}
{{- end -}}

{{/* POD_NAME and POD_NAMESPACE from the downward API. */}}
{{- define "apogee.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/* A grpc.health.v1 probe: (dict "port" 9876 "service" "" "timing" .Values.x.probes.liveness). */}}
{{- define "apogee.grpcProbe" -}}
grpc:
  port: {{ int .port }}
  {{- if .service }}
  service: {{ .service }}
  {{- end }}
{{- with .timing }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod anti-affinity from a preset, unless an affinity is given: (dict "root" $ "component" "broker" "values" $values). */}}
{{- define "apogee.affinity" -}}
{{- if .values.affinity -}}
{{ toYaml .values.affinity }}
{{- else if eq .values.podAntiAffinity "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "apogee.selectorLabels" . | nindent 10 }}
{{- else if eq .values.podAntiAffinity "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "apogee.selectorLabels" . | nindent 12 }}
{{- end -}}
{{- end -}}

{{/*
What every Apogee pod spec shares (after containers): security context, scheduling, /tmp.
(dict "root" $ "component" "broker" "values" $values "extraVolumes" "<yaml>")
*/}}
{{- define "apogee.podCommon" -}}
{{- $affinity := include "apogee.affinity" . -}}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- if $affinity }}
affinity:
  {{- $affinity | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: {{ .root.Values.tmpSizeLimit }}
{{- with .extraVolumes }}
  {{- . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The pod template's metadata: (dict "root" $ "component" "broker" "values" $values). */}}
{{- define "apogee.podMetadata" -}}
labels:
  {{- include "apogee.labels" . | nindent 2 }}
  {{- with .values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget: (dict "root" $ "component" "broker" "values" $values). */}}
{{- define "apogee.pdb" -}}
{{- if .values.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  {{- include "apogee.metadata" . | nindent 2 }}
spec:
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "apogee.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}
