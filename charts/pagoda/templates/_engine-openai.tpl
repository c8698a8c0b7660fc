{{/* gatewayAPI: an engine pod's OpenAI front. Engines speak only Pagoda's internal API, so a
Gateway that forwards an OpenAI request to the pod the picker chose needs something in that
pod that speaks OpenAI: Pagoda's gateway, pinned to the engine beside it (--engine-url, no
router), with the gateway's own API keys and the internal credential towards the engine. Its
port (named openai) is the InferencePool's targetPort and the port the picker answers (the
engine advertises it, --openai-port; the router's --ext-proc-target-port is the same). It
serves the engine's LoRA adapters as well, read from the engine. It drains as long as the engine does: SIGTERM reaches both after
the same preStop, and its open streams get the engine's --shutdown-timeout.
Call with (dict "root" $ "model" $m "shutdown" SECONDS). */}}
{{- define "pagoda.engine.openaiContainer" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $o := $root.Values.gatewayAPI.openai -}}
{{- $apiKeySecret := include "pagoda.gateway.apiKeySecret" $root -}}
- name: openai
  image: {{ include "pagoda.image" (dict "root" $root "image" $root.Values.images.service) }}
  imagePullPolicy: {{ $root.Values.images.service.pullPolicy }}
  command: ["python", "-m", "services.gateway"]
  args:
    - --host=0.0.0.0
    - --port={{ int $o.port }}
    - --engine-url=http://127.0.0.1:{{ int $root.Values.engine.port }}
    # The engine's own model directory: its tokenizer and chat template.
    - --model={{ include "pagoda.model.servedName" $m }}={{ include "pagoda.model.dir" (dict "model" $m "source" $m.source) }}
    - --request-timeout={{ $root.Values.gateway.requestTimeoutSeconds }}
    - --shutdown-grace={{ .shutdown }}
    {{- include "pagoda.internalAuth.arg" $root | nindent 4 }}
    {{- with $o.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    {{- include "pagoda.podEnv" $root | nindent 4 }}
    {{- if $apiKeySecret }}
    - name: PAGODA_API_KEYS
      valueFrom:
        secretKeyRef:
          name: {{ $apiKeySecret }}
          key: {{ $root.Values.gateway.apiKeys.secretKey }}
    {{- end }}
    {{- include "pagoda.block" (list 4 (include "pagoda.otelEnv" (dict "root" $root "component" "gateway" "model" (include "pagoda.model.servedName" $m)))) }}
  ports:
    - name: openai
      containerPort: {{ int $o.port }}
      protocol: TCP
  startupProbe:
    httpGet: {path: /health, port: openai}
    periodSeconds: 5
    failureThreshold: 60
  # /ready: the engine beside it answers /health with its model loaded.
  readinessProbe:
    httpGet: {path: /ready, port: openai}
    periodSeconds: 5
    timeoutSeconds: 5
    failureThreshold: 3
  livenessProbe:
    httpGet: {path: /health, port: openai}
    periodSeconds: 15
    timeoutSeconds: 5
    failureThreshold: 4
  {{- include "pagoda.block" (list 2 (include "pagoda.preStop" $root.Values.engine.preStopSleepSeconds)) }}
  resources:
    {{- toYaml $o.resources | nindent 4 }}
  {{- include "pagoda.containerSecurityContext" $root | nindent 2 }}
  volumeMounts:
    {{- include "pagoda.scratchVolumeMounts" $root | nindent 4 }}
    {{- include "pagoda.internalAuth.volumeMount" $root | nindent 4 }}
    {{- include "pagoda.block" (list 4 (include "pagoda.model.volumeMount" (dict "model" $m "source" $m.source "volume" "model"))) }}
{{- end -}}
