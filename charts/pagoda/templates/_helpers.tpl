{{/* ------------------------------------------------------------------------------------
Names
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name; component names append "-gateway", "-engine-<model>", ... */}}
{{- define "pagoda.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.gateway.fullname" -}}{{ include "pagoda.fullname" . }}-gateway{{- end -}}
{{- define "pagoda.router.fullname" -}}{{ include "pagoda.fullname" . }}-router{{- end -}}
{{- define "pagoda.redis.fullname" -}}{{ include "pagoda.fullname" . }}-redis{{- end -}}
{{/* The headless Service over every engine pod: the router watches its EndpointSlices. */}}
{{- define "pagoda.engines.fullname" -}}{{ include "pagoda.fullname" . }}-engines{{- end -}}
{{/* Pods that need no Kubernetes API token. */}}
{{- define "pagoda.workload.serviceAccountName" -}}{{ include "pagoda.fullname" . }}{{- end -}}

{{/* One model's engine Deployment/Service name. Call with (dict "root" $ "model" $m), and
"role" (prefill or decode) for one role's Deployment of a disaggregated model. */}}
{{- define "pagoda.engine.fullname" -}}
{{- $name := printf "%s-engine-%s" (include "pagoda.fullname" .root) .model.name -}}
{{- with .role }}{{ $name = printf "%s-%s" $name . }}{{ end -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "engine name %q is longer than 63 characters: shorten the release name, fullnameOverride or models[].name %q" $name .model.name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
Labels
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagoda.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagoda.labels" -}}
helm.sh/chart: {{ include "pagoda.chart" . }}
{{ include "pagoda.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagoda
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Call with (dict "root" $ "component" "gateway"). */}}
{{- define "pagoda.componentSelectorLabels" -}}
{{ include "pagoda.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pagoda.componentLabels" -}}
{{ include "pagoda.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* One model's engine pods. Call with (dict "root" $ "model" $m). */}}
{{- define "pagoda.engine.selectorLabels" -}}
{{ include "pagoda.componentSelectorLabels" (dict "root" .root "component" "engine") }}
pagoda.io/model: {{ .model.name }}
{{- with .role }}
pagoda.io/kv-role: {{ . }}
{{- end }}
{{- end -}}

{{- define "pagoda.engine.labels" -}}
{{ include "pagoda.componentLabels" (dict "root" .root "component" "engine") }}
pagoda.io/model: {{ .model.name }}
{{- with .role }}
pagoda.io/kv-role: {{ . }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
Disaggregated prefill/decode (a model's `disaggregation`)
------------------------------------------------------------------------------------ */}}

{{/* A model's engine roles, as JSON: ["prefill","decode"], or [""] (aggregated). */}}
{{- define "pagoda.engine.roles" -}}
{{- if .disaggregation }}["prefill","decode"]{{ else }}[""]{{ end -}}
{{- end -}}

{{/* Non-empty when some model has `disaggregation`. */}}
{{- define "pagoda.pd.enabled" -}}
{{- range .Values.models }}{{ if .disaggregation }}true{{ end }}{{ end -}}
{{- end -}}

{{- define "pagoda.engine.transferPort" -}}
{{- int (.disaggregation | default dict).transferPort | default 7100 -}}
{{- end -}}

{{/* A disaggregated model's KV transport: tcp (the default) or store. */}}
{{- define "pagoda.pd.transport" -}}
{{- (.disaggregation | default dict).transport | default "tcp" -}}
{{- end -}}

{{/* Non-empty when some disaggregated model moves its KV over TCP (the transfer port). */}}
{{- define "pagoda.pd.tcp" -}}
{{- range .Values.models }}{{ if and .disaggregation (eq (include "pagoda.pd.transport" .) "tcp") }}true{{ end }}{{ end -}}
{{- end -}}

{{/* An engine's --kv-transfer-config (empty: none): the model's kvTransferConfig and, for a
P/D role, its P/D connector (kv_producer on prefill engines, kv_consumer on decode engines):
over tcp PagodaPDConnector (the prefill engine's transfer server listens on the pod IP), over
the store PagodaStorePDConnector (the KV store's URL is the engine's --kv-store-url); both
under a MultiConnector, P/D first (a decode engine takes the prompt from the prefill engine
before its own tiers). */}}
{{- define "pagoda.engine.kvTransferConfig" -}}
{{- $own := .model.kvTransferConfig -}}
{{- if .role -}}
{{- $extra := dict "engine_id" "$(POD_NAME)" -}}
{{- $connector := "PagodaStorePDConnector" -}}
{{- if eq .transport "tcp" -}}
{{- $connector = "PagodaPDConnector" -}}
{{- if eq .role "prefill" -}}
{{- $extra = merge $extra (dict "host" "0.0.0.0" "advertise_host" "$(POD_IP)" "port" (int .port)) -}}
{{- end -}}
{{- end -}}
{{- $pd := dict "kv_connector" $connector "kv_role" (eq .role "prefill" | ternary "kv_producer" "kv_consumer") "kv_connector_extra_config" $extra -}}
{{- if $own -}}
{{- toJson (dict "kv_connector" "MultiConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "connectors" (list $pd $own))) -}}
{{- else -}}
{{- toJson $pd -}}
{{- end -}}
{{- else if $own -}}
{{- toJson $own -}}
{{- end -}}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
Images
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag | toString) -}}
{{- end -}}

{{- define "pagoda.imagePullSecrets" -}}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
Pod pieces shared by every component
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.podSecurityContext" -}}
securityContext:
{{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{- define "pagoda.containerSecurityContext" -}}
securityContext:
{{- toYaml .Values.containerSecurityContext | nindent 2 }}
{{- end -}}

{{/* preStop: keep serving while the endpoint removal reaches the router and kube-proxy. */}}
{{- define "pagoda.preStop" -}}
{{- if gt (int .) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ int . }}"]
{{- end }}
{{- end -}}

{{/* Downward API: the pod's own name, IP and namespace. */}}
{{- define "pagoda.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* OTEL_* for one component. Call with (dict "root" $ "component" "gateway" "model" "x"). */}}
{{- define "pagoda.otelEnv" -}}
{{- $otel := .root.Values.otel -}}
{{- if $otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $otel.protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $otel.serviceNamePrefix .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),service.instance.id=$(POD_NAME)" .root.Release.Namespace }}{{ with .model }},pagoda.model={{ . }}{{ end }}
{{- with $otel.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Writable scratch for a read-only root filesystem. */}}
{{- define "pagoda.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end -}}

{{- define "pagoda.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: cache
  emptyDir:
    sizeLimit: {{ default "1Gi" .cacheSize }}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
Redis
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.redis.bundled" -}}
{{- if not .Values.redis.url }}true{{ end -}}
{{- end -}}

{{- define "pagoda.redis.secretName" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecret -}}
{{- else if include "pagoda.redis.bundled" . -}}
{{- include "pagoda.redis.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.redis.secretKey" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecretKey -}}
{{- else -}}
redis-password
{{- end -}}
{{- end -}}

{{- define "pagoda.redis.tlsMountPath" -}}/etc/pagoda/redis-tls{{- end -}}

{{/* The Redis URL the router and engines are started with. It holds no credentials: the
services read REDIS_PASSWORD (and REDIS_USERNAME) from their environment, filled from the
Secret, so the password never shows in a manifest or in a process's arguments. */}}
{{- define "pagoda.redis.url" -}}
{{- if include "pagoda.redis.bundled" . -}}
{{- printf "redis://%s:%d/0" (include "pagoda.redis.fullname" .) (int .Values.redis.bundled.port) -}}
{{- else -}}
{{- $u := urlParse .Values.redis.url -}}
{{- if $u.userinfo -}}
{{- fail "redis.url must not hold credentials: put the password in a Secret and name it in redis.auth.existingSecret" -}}
{{- end -}}
{{- $query := $u.query -}}
{{- if .Values.redis.tls.caSecret -}}
{{- if ne $u.scheme "rediss" -}}
{{- fail "redis.tls.caSecret is set but redis.url is not rediss://" -}}
{{- end -}}
{{- $ca := printf "ssl_ca_certs=%s/%s" (include "pagoda.redis.tlsMountPath" .) .Values.redis.tls.caKey -}}
{{- $query = ternary $ca (printf "%s&%s" $query $ca) (eq $query "") -}}
{{- end -}}
{{- printf "%s://%s%s" $u.scheme $u.host $u.path -}}
{{- if $query }}?{{ $query }}{{ end -}}
{{- end -}}
{{- end -}}

{{/* Env, volume mounts and volumes of a Redis client (router, engines). */}}
{{- define "pagoda.redis.clientEnv" -}}
{{- $secret := include "pagoda.redis.secretName" . -}}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "pagoda.redis.secretKey" . }}
{{- if and (not (include "pagoda.redis.bundled" .)) .Values.redis.auth.username }}
- name: REDIS_USERNAME
  value: {{ .Values.redis.auth.username | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pagoda.redis.clientVolumeMounts" -}}
{{- if and (not (include "pagoda.redis.bundled" .)) .Values.redis.tls.caSecret }}
- name: redis-tls
  mountPath: {{ include "pagoda.redis.tlsMountPath" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pagoda.redis.clientVolumes" -}}
{{- if and (not (include "pagoda.redis.bundled" .)) .Values.redis.tls.caSecret }}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.tls.caSecret }}
    items:
      - key: {{ .Values.redis.tls.caKey }}
        path: {{ .Values.redis.tls.caKey }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
Models
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.builtinModelDir" -}}/opt/pagoda/models/SmolLM2-135M-Instruct{{- end -}}

{{/* Where a pod finds the model directory. Call with (dict "model" $m "source" $src). */}}
{{- define "pagoda.model.dir" -}}
{{- if eq .source.type "builtin" -}}
{{- include "pagoda.builtinModelDir" . -}}
{{- else -}}
/models/{{ .model.name }}
{{- end -}}
{{- end -}}

{{/* A model's speculativeConfig as the engine's --speculative-config JSON; with a
draftSource, the draft is that source's directory (mounted at /models/<name>-draft). */}}
{{- define "pagoda.speculativeConfig" -}}
{{- $spec := deepCopy .speculativeConfig -}}
{{- if .draftSource -}}
{{- $_ := set $spec "model" (include "pagoda.model.dir" (dict "model" (include "pagoda.draftModel" . | fromYaml) "source" .draftSource)) -}}
{{- end -}}
{{- toJson $spec -}}
{{- end -}}

{{/* The model entry its draft's volume helpers take: named <name>-draft. */}}
{{- define "pagoda.draftModel" -}}
name: {{ printf "%s-draft" .name }}
{{- end -}}

{{/* The model entry its adapters' volume helpers take: named <name>-lora. */}}
{{- define "pagoda.loraModel" -}}
name: {{ printf "%s-lora" .name }}
{{- end -}}

{{/* Where a model's LoRA adapters live in the engine pod: their own volume
(/models/<name>-lora) or the model's directory. Call with the model entry. */}}
{{- define "pagoda.lora.root" -}}
{{- if .lora.source -}}
{{- include "pagoda.model.dir" (dict "model" (include "pagoda.loraModel" . | fromYaml) "source" .lora.source) -}}
{{- else -}}
{{- include "pagoda.model.dir" (dict "model" . "source" .source) -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.model.servedName" -}}
{{- default .name .servedModelName -}}
{{- end -}}

{{- define "pagoda.model.claimName" -}}
{{- if .model.source.pvc.claimName -}}
{{- .model.source.pvc.claimName -}}
{{- else -}}
{{- printf "%s-model-%s" (include "pagoda.fullname" .root) .model.name -}}
{{- end -}}
{{- end -}}

{{/* The model volume of a pod (none for builtin). Call with
(dict "root" $ "model" $m "source" $src "volume" "model" ["sizeLimit" "1Gi"]); sizeLimit
overrides the image copy's emptyDir limit. A created claim is named after the model. */}}
{{- define "pagoda.model.volume" -}}
{{- $src := .source -}}
{{- if eq $src.type "pvc" }}
- name: {{ .volume }}
  persistentVolumeClaim:
    claimName: {{ $src.pvc.claimName | default (printf "%s-model-%s" (include "pagoda.fullname" .root) .model.name) }}
    readOnly: true
{{- else if eq $src.type "hostPath" }}
- name: {{ .volume }}
  hostPath:
    path: {{ $src.hostPath.path }}
    type: {{ $src.hostPath.type | default "Directory" }}
{{- else if eq $src.type "image" }}
- name: {{ .volume }}
  {{- $limit := .sizeLimit | default $src.image.sizeLimit }}
  {{- if $limit }}
  emptyDir:
    sizeLimit: {{ $limit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "pagoda.model.volumeMount" -}}
{{- $src := .source -}}
{{- if ne $src.type "builtin" }}
- name: {{ .volume }}
  mountPath: /models/{{ .model.name }}
  readOnly: true
  {{- if and (eq $src.type "pvc") $src.pvc.subPath }}
  subPath: {{ $src.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Files the gateway needs from a model directory: tokenizer, chat template, config. */}}
{{- define "pagoda.tokenizerFiles" -}}
config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json tokenizer.model vocab.json vocab.txt merges.txt chat_template.jinja chat_template.json
{{- end -}}

{{/* Init container copying an image-held model into the pod's emptyDir. Call with
(dict "root" $ "model" $m "source" $src "volume" "model" "tokenizerOnly" bool). */}}
{{- define "pagoda.model.initContainer" -}}
{{- $img := .source.image -}}
{{- $dest := printf "/models/%s" .model.name -}}
- name: {{ .volume }}-copy
  image: {{ printf "%s:%s" $img.repository ($img.tag | default "latest" | toString) }}
  imagePullPolicy: {{ $img.pullPolicy | default "IfNotPresent" }}
  {{- if .tokenizerOnly }}
  command:
    - sh
    - -c
    - |
      set -eu
      for f in {{ include "pagoda.tokenizerFiles" . }}; do
        if [ -e "{{ $img.path }}/$f" ]; then cp "{{ $img.path }}/$f" "{{ $dest }}/"; fi
      done
      if [ ! -e "{{ $dest }}/tokenizer_config.json" ] && [ ! -e "{{ $dest }}/tokenizer.json" ]; then
        echo "no tokenizer files in {{ $img.path }} of {{ $img.repository }}" >&2
        exit 1
      fi
  {{- else }}
  command: ["cp", "-R", "{{ $img.path }}/.", "{{ $dest }}/"]
  {{- end }}
  {{- include "pagoda.containerSecurityContext" .root | nindent 2 }}
  resources:
    requests: {cpu: 100m, memory: 128Mi}
    limits: {memory: 512Mi}
  volumeMounts:
    - name: {{ .volume }}
      mountPath: {{ $dest }}
{{- end -}}

{{/* A block indented like nindent, or nothing when it is blank (no stray blank lines).
Call with (list INDENT TEXT). */}}
{{- define "pagoda.block" -}}
{{- $text := trim (index . 1) -}}
{{- if $text }}{{ nindent (index . 0) $text }}{{ end -}}
{{- end -}}

{{/* The shared KV store (kvStore.enabled): its name, Secret and URL (no credentials: the
engines read KV_STORE_PASSWORD from the Secret). */}}
{{- define "pagoda.kvStore.fullname" -}}{{ include "pagoda.fullname" . }}-kv-store{{- end -}}

{{- define "pagoda.kvStore.secretName" -}}
{{- .Values.kvStore.auth.existingSecret | default (include "pagoda.kvStore.fullname" .) -}}
{{- end -}}

{{- define "pagoda.kvStore.secretKey" -}}
{{- if .Values.kvStore.auth.existingSecret -}}
{{- .Values.kvStore.auth.existingSecretKey -}}
{{- else -}}
kv-store-password
{{- end -}}
{{- end -}}

{{- define "pagoda.kvStore.url" -}}
{{- printf "redis://%s:%d/0" (include "pagoda.kvStore.fullname" .) (int .Values.kvStore.port) -}}
{{- end -}}

{{/* ------------------------------------------------------------------------------------
The internal credential (internalAuth): a Secret of tokens, one per line, mounted as a file
into the gateway, router and engine pods; each reads it with --internal-token-file.
------------------------------------------------------------------------------------- */}}

{{- define "pagoda.internalAuth.secretName" -}}
{{- .Values.internalAuth.existingSecret | default (printf "%s-internal-auth" (include "pagoda.fullname" .)) -}}
{{- end -}}

{{- define "pagoda.internalAuth.mountPath" -}}/etc/pagoda/internal-auth{{- end -}}

{{- define "pagoda.internalAuth.arg" -}}
- --internal-token-file={{ include "pagoda.internalAuth.mountPath" . }}/{{ .Values.internalAuth.secretKey }}
{{- end -}}

{{- define "pagoda.internalAuth.volumeMount" -}}
- name: internal-auth
  mountPath: {{ include "pagoda.internalAuth.mountPath" . }}
  readOnly: true
{{- end -}}

{{- define "pagoda.internalAuth.volume" -}}
- name: internal-auth
  secret:
    secretName: {{ include "pagoda.internalAuth.secretName" . }}
    items:
      - key: {{ .Values.internalAuth.secretKey }}
        path: {{ .Values.internalAuth.secretKey }}
{{- end -}}

{{/* The Secret of the gateway's API keys, "" when the API is open: the gateway and each
engine pod's OpenAI front (gatewayAPI) read it as $PAGODA_API_KEYS. */}}
{{- define "pagoda.gateway.apiKeySecret" -}}
{{- $keys := .Values.gateway.apiKeys -}}
{{- $keys.existingSecret | default (ternary (printf "%s-api-keys" (include "pagoda.gateway.fullname" .)) "" (gt (len $keys.keys) 0)) -}}
{{- end -}}

{{/* Every NetworkPolicy's extra ingress rules (networkPolicy.extraIngress: a mesh). */}}
{{- define "pagoda.networkPolicy.extraIngress" -}}
{{- with .Values.networkPolicy.extraIngress }}
{{ toYaml . }}
{{- end }}
{{- end -}}


{{- /* Flow control's flags, the same on the gateway and the router (the picker). */}}
{{- define "pagoda.flowControl.args" -}}
{{- $f := .Values.flowControl }}
{{- if $f.enabled }}
- --flow-control
- --flow-queue-depth={{ int $f.queueDepth }}
- --flow-kv-usage={{ $f.kvUsage }}
- --shed-after-s={{ $f.shedAfterSeconds }}
- --flow-max-queued={{ int $f.maxQueued }}
- --flow-max-queued-per-tenant={{ int $f.maxQueuedPerTenant }}
{{- if not (kindIs "invalid" $f.sheddablePriority) }}
- --sheddable-priority={{ int $f.sheddablePriority }}
{{- end }}
{{- end }}
{{- end -}}
