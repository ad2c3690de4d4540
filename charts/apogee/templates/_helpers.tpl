{{/*
Names, labels, images and the pieces every Apogee pod shares.
A component is one of: nameserver, broker, schedule, txn-checker, console (and test, operator).
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

{{/*
Selector labels: stable over upgrades, never the chart version. An optional "selector" map
narrows them (a broker replica group's apogee.io/broker-group).
*/}}
{{- define "apogee.selectorLabels" -}}
app.kubernetes.io/name: {{ include "apogee.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .selector }}
{{ toYaml . }}
{{- end }}
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

{{/*
The prefix of the brokers' group Leases (broker.replication): Lease <prefix>-<broker name>,
e.g. apogee-replicas-apogee-broker-0.
*/}}
{{- define "apogee.brokerLeasePrefix" -}}
{{- printf "%s-replicas" (include "apogee.fullname" .) -}}
{{- end -}}

{{/* The service account of the schedule and txn-checker pods, and of the brokers in replica groups. */}}
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
What every Apogee pod spec shares (after containers): security context, scheduling, /tmp, the
security Secrets (apogee.securityVolumes).
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
{{- with include "apogee.securityVolumes" . }}
  {{- . | trim | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The pod template's metadata: (dict "root" $ "component" "broker" "values" $values). */}}
{{- define "apogee.podMetadata" -}}
labels:
  {{- include "apogee.labels" . | nindent 2 }}
  {{- with .selector }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
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

{{/*
Security (values security.*, docs/security.md): what each pod is given. A component's role:
the nameservers serve but call no one (TLS and the users file); the brokers, the schedule
service, the transaction checker, the operator and the console also sign their calls (the
service credentials; the console those of console.credentialsSecret when set, and it checks
its logins against the users file); the helm test pod is a client (the CA, its client certificate with
clientAuth=require, the client credentials). Secrets are mounted read-only with mode 0440
(the pods' fsGroup reads them) under /etc/apogee/tls and /etc/apogee/auth.
*/}}
{{- define "apogee.securityRole" -}}
{{- if eq .component "nameserver" -}}server
{{- else if eq .component "test" -}}client
{{- else -}}service
{{- end -}}
{{- end -}}

{{/* The name the probes and the ServiceMonitor expect in the services' certificate. */}}
{{- define "apogee.tlsServerName" -}}
{{- if .Values.security.tls.serverName -}}
{{- .Values.security.tls.serverName -}}
{{- else -}}
{{- $broker := include "apogee.componentName" (dict "root" . "component" "broker") -}}
{{- printf "%s-0.%s.%s" $broker $broker (include "apogee.svcDomain" .) -}}
{{- end -}}
{{- end -}}

{{/*
The security settings of a service, as env entries: (dict "root" $ "component" "broker"
"prefix" "BROKER", optional "clientAuth": what the service asks of its callers instead of
security.tls.clientAuth); and of the helm test pod (component "test"), the client's variables.
Empty with security off. The probe's variables (APOGEE_PROBE_TLS_*) are read by
`python -m apogee.rpc.probe`, the exec probes' and the images' HEALTHCHECK command.
*/}}
{{- define "apogee.securityEnv" -}}
{{- $security := .root.Values.security -}}
{{- $role := include "apogee.securityRole" . -}}
{{- $mutual := eq $security.tls.clientAuth "require" -}}
{{- $clientAuth := .clientAuth | default $security.tls.clientAuth -}}
{{- $env := list -}}
{{- if $security.tls.enabled -}}
{{- if eq $role "client" -}}
{{- $env = append $env (dict "name" "APOGEE_TLS_CA_FILE" "value" "/etc/apogee/tls/ca.crt") -}}
{{- if $mutual -}}
{{- $env = append $env (dict "name" "APOGEE_TLS_CERT_FILE" "value" "/etc/apogee/tls/tls.crt") -}}
{{- $env = append $env (dict "name" "APOGEE_TLS_KEY_FILE" "value" "/etc/apogee/tls/tls.key") -}}
{{- end -}}
{{- else -}}
{{- $p := printf "APOGEE_%s_" .prefix -}}
{{- $env = append $env (dict "name" (print $p "TLS_CERT_FILE") "value" "/etc/apogee/tls/tls.crt") -}}
{{- $env = append $env (dict "name" (print $p "TLS_KEY_FILE") "value" "/etc/apogee/tls/tls.key") -}}
{{- $env = append $env (dict "name" (print $p "TLS_CA_FILE") "value" "/etc/apogee/tls/ca.crt") -}}
{{- $env = append $env (dict "name" (print $p "TLS_CLIENT_AUTH") "value" $clientAuth) -}}
{{- $env = append $env (dict "name" "APOGEE_PROBE_TLS_CA" "value" "/etc/apogee/tls/ca.crt") -}}
{{- $env = append $env (dict "name" "APOGEE_PROBE_TLS_SERVER_NAME" "value" (include "apogee.tlsServerName" .root)) -}}
{{- if $mutual -}}
{{- $env = append $env (dict "name" "APOGEE_PROBE_TLS_CERT" "value" "/etc/apogee/tls/tls.crt") -}}
{{- $env = append $env (dict "name" "APOGEE_PROBE_TLS_KEY" "value" "/etc/apogee/tls/tls.key") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $security.auth.enabled -}}
{{- if eq $role "client" -}}
{{- $env = append $env (dict "name" "APOGEE_CREDENTIALS_FILE" "value" "/etc/apogee/auth/credentials.toml") -}}
{{- else -}}
{{- $p := printf "APOGEE_%s_" .prefix -}}
{{- $env = append $env (dict "name" (print $p "AUTH_ENABLED") "value" "true") -}}
{{- $env = append $env (dict "name" (print $p "AUTH_USERS_FILE") "value" "/etc/apogee/auth/users.toml") -}}
{{- if eq $role "service" -}}
{{- $env = append $env (dict "name" (print $p "AUTH_CREDENTIALS_FILE") "value" "/etc/apogee/auth/credentials.toml") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $env }}{{ toYaml $env }}{{ end -}}
{{- end -}}

{{/* The security Secrets' volumeMounts: (dict "root" $ "component" "broker"); empty when off. */}}
{{- define "apogee.securityVolumeMounts" -}}
{{- $security := .root.Values.security -}}
{{- if $security.tls.enabled }}
- name: tls
  mountPath: /etc/apogee/tls
  readOnly: true
{{- end }}
{{- if $security.auth.enabled }}
- name: auth
  mountPath: /etc/apogee/auth
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The security Secrets' volumes: (dict "root" $ "component" "broker", optional
"credentialsSecret" instead of security.auth.serviceCredentialsSecret); empty when off. The
auth volume projects the users file and the credentials of the component's role into one
directory.
*/}}
{{- define "apogee.securityVolumes" -}}
{{- $security := .root.Values.security -}}
{{- $role := include "apogee.securityRole" . -}}
{{- if $security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $security.tls.existingSecret }}
    defaultMode: 288  # 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if $security.auth.enabled }}
- name: auth
  projected:
    defaultMode: 288  # 0440
    sources:
      {{- if ne $role "client" }}
      - secret:
          name: {{ $security.auth.usersSecret }}
          items:
            - {key: users.toml, path: users.toml}
      {{- end }}
      {{- if ne $role "server" }}
      - secret:
          name: {{ eq $role "client" | ternary ($security.auth.clientCredentialsSecret | default $security.auth.serviceCredentialsSecret) (.credentialsSecret | default $security.auth.serviceCredentialsSecret) }}
          items:
            - {key: credentials.toml, path: credentials.toml}
      {{- end }}
{{- end }}
{{- end -}}

{{/*
A health probe: (dict "root" $ "port" 9876 "service" "" "timing" .Values.x.probes.liveness).
Kubernetes' gRPC probe when TLS is off; with security.tls.enabled an exec probe running
`python -m apogee.rpc.probe` (which the images carry; their HEALTHCHECK runs it too) against
127.0.0.1 over TLS, configured by the container's APOGEE_PROBE_TLS_* variables. Its own
deadline (--timeout) is three quarters of the probe's timeoutSeconds, leaving the rest to start
Python.
*/}}
{{- define "apogee.probe" -}}
{{- if .root.Values.security.tls.enabled -}}
{{- $timeout := (.timing | default dict).timeoutSeconds | default 1 -}}
{{- $command := list "python" "-m" "apogee.rpc.probe" "--timeout" (printf "%g" (mulf $timeout 0.75)) (printf "127.0.0.1:%d" (int .port)) -}}
{{- if .service }}{{ $command = append $command .service }}{{ end -}}
exec:
  command:
    {{- toYaml $command | nindent 4 }}
{{- with .timing }}
{{ toYaml . }}
{{- end }}
{{- else -}}
{{- include "apogee.grpcProbe" . -}}
{{- end -}}
{{- end -}}
