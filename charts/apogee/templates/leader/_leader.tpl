{{/*
The schedule service and the transaction checker: replicas of which one is active, chosen by a
Kubernetes Lease (leadership.mode=lease) or a lock file in the pod (file, one replica).
Both serve only grpc.health.v1: the overall status is SERVING on the active replica only, the
process service (apogee.schedule.Process, apogee.txn_checker.Process) on every running one.
The probes use the process service, so a standby is ready: with the overall status a standby
would never be ready, a rolling update would wait for it forever and the PodDisruptionBudget
would never let a drain evict the active replica.
(dict "root" $ "component" "schedule" "values" .Values.schedule "prefix" "SCHEDULE"
      "process" "apogee.schedule.Process")
*/}}
{{- define "apogee.leaderWorkload" -}}
{{- $root := .root -}}
{{- $values := .values -}}
{{- $ctx := dict "root" .root "component" .component "values" .values -}}
{{- $name := include "apogee.componentName" $ctx -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  {{- include "apogee.metadata" $ctx | nindent 2 }}
spec:
  replicas: {{ $values.replicas }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "apogee.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      {{- include "apogee.podMetadata" $ctx | nindent 6 }}
    spec:
      serviceAccountName: {{ include "apogee.serviceAccountName" $root }}
      # the Lease is read and renewed through the API server
      automountServiceAccountToken: {{ eq $root.Values.leadership.mode "lease" }}
      enableServiceLinks: false
      containers:
        - name: {{ .component }}
          image: {{ include "apogee.image" (dict "root" $root "image" $values.image) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          env:
            {{- include "apogee.podEnv" . | nindent 12 }}
            - name: APOGEE_{{ .prefix }}_LISTEN
              value: "0.0.0.0:{{ $values.ports.grpc }}"
            - name: APOGEE_{{ .prefix }}_METRICS_LISTEN
              value: "0.0.0.0:{{ $values.ports.metrics }}"
            - name: APOGEE_{{ .prefix }}_NAMESRV
              value: {{ include "apogee.namesrv" $root | quote }}
            - name: APOGEE_{{ .prefix }}_LOG_LEVEL
              value: {{ $values.logLevel | quote }}
            - name: APOGEE_{{ .prefix }}_LEADERSHIP
              value: {{ $root.Values.leadership.mode | quote }}
            {{- if eq $root.Values.leadership.mode "lease" }}
            - name: APOGEE_{{ .prefix }}_LEASE_NAME
              value: {{ $values.leaseName | default $name | quote }}
            {{- end }}
            # the root file system is read-only: a lock file (leadership.mode=file) lives on /tmp
            - name: APOGEE_{{ .prefix }}_LOCK_FILE
              value: /tmp/{{ .component }}.lock
            {{- with include "apogee.securityEnv" (dict "root" $root "component" .component "prefix" .prefix) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "apogee.settingsEnv" (dict "prefix" .prefix "settings" $values.settings) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $values.ports.grpc }}
            - name: metrics
              containerPort: {{ $values.ports.metrics }}
          startupProbe:
            {{- include "apogee.probe" (dict "root" $root "port" $values.ports.grpc "service" .process "timing" $values.probes.startup) | nindent 12 }}
          readinessProbe:
            {{- include "apogee.probe" (dict "root" $root "port" $values.ports.grpc "service" .process "timing" $values.probes.readiness) | nindent 12 }}
          livenessProbe:
            {{- include "apogee.probe" (dict "root" $root "port" $values.ports.grpc "service" .process "timing" $values.probes.liveness) | nindent 12 }}
          {{- with $values.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- with include "apogee.securityVolumeMounts" $ctx }}
            {{- . | trim | nindent 12 }}
            {{- end }}
      {{- include "apogee.podCommon" $ctx | nindent 6 }}
---
# Headless, for the metrics (ServiceMonitor) and to find the replicas; no client calls them.
apiVersion: v1
kind: Service
metadata:
  {{- include "apogee.metadata" (merge (dict "labels" (dict "apogee.io/metrics" "true")) $ctx) | nindent 2 }}
spec:
  clusterIP: None
  selector:
    {{- include "apogee.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $values.ports.grpc }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ $values.ports.metrics }}
      targetPort: metrics
      appProtocol: http
{{- with include "apogee.pdb" $ctx }}
---
{{- . }}
{{- end }}
{{- end -}}
