{{/*
Names, labels and the values-derived settings every template shares.
*/}}

{{- define "draftmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "draftmesh.fullname" -}}
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

{{/* A child resource name: <fullname>-<suffix>, within 63 characters. */}}
{{- define "draftmesh.childName" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "draftmesh.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- end -}}

{{/* KubeRay appends "-xxxxx" to a RayService's name for its RayCluster and caps that at 53. */}}
{{- define "draftmesh.rayServiceName" -}}
{{- include "draftmesh.fullname" . | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{- define "draftmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels every pod of the release carries, Ray pods included: the release-wide peer selector
of the NetworkPolicies. (Ray pods do not get app.kubernetes.io/name: KubeRay sets it to
"kuberay" and selects its head Service on it.)
*/}}
{{- define "draftmesh.releaseSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "draftmesh.name" . }}
{{- end -}}

{{- define "draftmesh.commonLabels" -}}
helm.sh/chart: {{ include "draftmesh.chart" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
{{- end -}}

{{/* Selector labels of a plain workload: (list $ "component"). */}}
{{- define "draftmesh.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "draftmesh.name" $root }}
{{ include "draftmesh.releaseSelectorLabels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of a plain workload's objects and pods: (list $ "component"). */}}
{{- define "draftmesh.labels" -}}
{{ include "draftmesh.selectorLabels" . }}
{{ include "draftmesh.commonLabels" (index . 0) }}
{{- end -}}

{{/* Selector labels of one Ray node group's pods: (list $ "ray-head"). */}}
{{- define "draftmesh.raySelectorLabels" -}}
{{- $root := index . 0 -}}
{{ include "draftmesh.releaseSelectorLabels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Labels of objects that are not pods (Services, Secrets, policies): (list $ "component"). */}}
{{- define "draftmesh.objectLabels" -}}
{{ include "draftmesh.labels" . }}
{{- end -}}

{{/* The three Ray components, for selectors over every Ray pod. */}}
{{- define "draftmesh.rayComponents" -}}
ray-head,ray-worker-gpu,ray-worker-cpu
{{- end -}}

{{/* image reference: (list $ imageValues) with empty fields falling back to .Values.image. */}}
{{- define "draftmesh.image" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 -}}
{{- $repo := default $root.Values.image.repository $img.repository -}}
{{- $tag := default (default $root.Chart.AppVersion $root.Values.image.tag) $img.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* The Redis URL the mesh and the workers use. */}}
{{- define "draftmesh.redisUrl" -}}
{{- if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else -}}
{{- printf "redis://%s:6379/0" (include "draftmesh.childName" (list . "redis")) -}}
{{- end -}}
{{- end -}}

{{/* The OTLP endpoint ("" when tracing is off). */}}
{{- define "draftmesh.otlpEndpoint" -}}
{{- if .Values.tracing.enabled -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- else if .Values.jaeger.enabled -}}
{{- $port := ternary 4317 4318 (eq .Values.tracing.otlpProtocol "grpc") -}}
{{- printf "http://%s:%d" (include "draftmesh.childName" (list . "jaeger")) $port -}}
{{- else -}}
{{- fail "tracing.enabled needs a collector: set tracing.otlpEndpoint, or jaeger.enabled=true for the in-chart Jaeger" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Keys for a Secret the chart creates: auth.apiKeys or any tenant's apiKeys. */}}
{{- define "draftmesh.chartKeys" -}}
{{- $found := .Values.auth.apiKeys -}}
{{- range $name, $tenant := .Values.auth.tenants -}}
{{- if $tenant.apiKeys -}}{{- $found = true -}}{{- end -}}
{{- end -}}
{{- if $found -}}true{{- end -}}
{{- end -}}

{{/* Does the release authenticate (an existing Secret or keys to put into one)? */}}
{{- define "draftmesh.authEnabled" -}}
{{- if or .Values.auth.existingSecret (include "draftmesh.chartKeys" .) -}}true{{- end -}}
{{- end -}}

{{- define "draftmesh.authSecretName" -}}
{{- default (include "draftmesh.childName" (list . "api-keys")) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The file the router reads the keys from (serve.api_keys_file in the app's config). */}}
{{- define "draftmesh.apiKeysFile" -}}
{{- printf "%s/%s" (.Values.auth.mountPath | trimSuffix "/") .Values.auth.secretKey -}}
{{- end -}}

{{/*
GPU pods for n replicas of g GPUs each: (list $ n g). Ray packs fractional GPUs (g < 1) floor(1/g)
to a GPU; g >= 1 takes g whole GPUs of one pod.
*/}}
{{- define "draftmesh.podsFor" -}}
{{- $root := index . 0 -}}
{{- $n := float64 (index . 1) -}}
{{- $g := float64 (index . 2) -}}
{{- $perGpuPod := float64 $root.Values.rayService.gpuWorkers.gpusPerPod -}}
{{- if or (eq $g 0.0) (eq $n 0.0) -}}
0
{{- else -}}
{{- $perPod := ternary (floor (divf $perGpuPod $g)) (mulf $perGpuPod (floor (divf 1 $g))) (ge $g 1.0) -}}
{{- if eq $perPod 0.0 -}}
{{- fail (printf "a replica asking for %v GPUs does not fit in a pod of rayService.gpuWorkers.gpusPerPod=%v GPUs: a replica must fit in one pod" $g $perGpuPod) -}}
{{- end -}}
{{- ceil (divf $n $perPod) | int -}}
{{- end -}}
{{- end -}}

{{/*
GPU pods for n verifier replicas plus the enabled draft deployments that ask for GPUs: (list $ n).
Each deployment is packed on its own pods (a safe upper bound).
*/}}
{{- define "draftmesh.gpuPodsFor" -}}
{{- $root := index . 0 -}}
{{- $pods := int (include "draftmesh.podsFor" (list $root (index . 1) $root.Values.verifier.numGpus)) -}}
{{- range $name, $spec := $root.Values.sources.deployments -}}
{{- if $spec.enabled -}}
{{- $pods = add $pods (int (include "draftmesh.podsFor" (list $root $spec.replicas $spec.numGpus))) -}}
{{- end -}}
{{- end -}}
{{- $pods -}}
{{- end -}}

{{/*
Checks across values that values.schema.json cannot express; rendered (empty) by the RayService
template so that `helm install` fails with the message.
*/}}
{{- define "draftmesh.validate" -}}
{{- $v := .Values -}}
{{- if $v.rayService.gpuWorkers.enabled -}}
{{- if gt (float64 $v.verifier.numGpus) (float64 $v.rayService.gpuWorkers.gpusPerPod) -}}
{{- fail (printf "verifier.numGpus (%v) is more than rayService.gpuWorkers.gpusPerPod (%v): a replica must fit in one pod" $v.verifier.numGpus $v.rayService.gpuWorkers.gpusPerPod) -}}
{{- end -}}
{{- range $name, $spec := $v.sources.deployments -}}
{{- if and $spec.enabled (gt (float64 $spec.numGpus) (float64 $v.rayService.gpuWorkers.gpusPerPod)) -}}
{{- fail (printf "sources.deployments.%s.numGpus (%v) is more than rayService.gpuWorkers.gpusPerPod: a replica must fit in one pod" $name $spec.numGpus) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $name, $spec := $v.sources.deployments -}}
{{- if and $spec.enabled (has $name $v.sources.enabled) -}}
{{- fail (printf "sources.deployments.%s is enabled and %s is also in sources.enabled: a source runs either in the verifier or as its own deployment" $name $name) -}}
{{- end -}}
{{- end -}}
{{- range $name, $spec := $v.sources.external -}}
{{- if has $name $v.sources.enabled -}}
{{- fail (printf "sources.external.%s: %s is also in sources.enabled" $name $name) -}}
{{- end -}}
{{- if hasKey $v.sources.deployments $name -}}
{{- if (index $v.sources.deployments $name).enabled -}}
{{- fail (printf "sources.external.%s: %s is also an enabled entry of sources.deployments" $name $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (gt (float64 $v.verifier.numGpus) 0.0) (not $v.rayService.gpuWorkers.enabled) -}}
{{- fail (printf "verifier.numGpus is %v but rayService.gpuWorkers.enabled is false: no pod would have a GPU" $v.verifier.numGpus) -}}
{{- end -}}
{{- if not $v.rayService.gpuWorkers.enabled -}}
{{- range $name, $spec := $v.sources.deployments -}}
{{- if and $spec.enabled (gt (float64 $spec.numGpus) 0.0) -}}
{{- fail (printf "sources.deployments.%s.numGpus is %v but rayService.gpuWorkers.enabled is false: no pod would have a GPU" $name $spec.numGpus) -}}
{{- end -}}
{{- end -}}
{{- else if and (kindIs "invalid" $v.rayService.gpuWorkers.replicas) (eq (int (include "draftmesh.gpuPodsFor" (list . $v.verifier.replicas))) 0) -}}
{{- fail "nothing asks for a GPU (verifier.numGpus is 0, no draft deployment with numGpus): set rayService.gpuWorkers.enabled=false, or rayService.gpuWorkers.replicas" -}}
{{- end -}}
{{- if $v.verifier.autoscaling.enabled -}}
{{- if gt (int $v.verifier.autoscaling.minReplicas) (int $v.verifier.autoscaling.maxReplicas) -}}
{{- fail (printf "verifier.autoscaling.minReplicas (%v) is above maxReplicas (%v)" $v.verifier.autoscaling.minReplicas $v.verifier.autoscaling.maxReplicas) -}}
{{- end -}}
{{- if gt (float64 $v.verifier.autoscaling.targetOngoingRequests) (float64 $v.verifier.maxOngoingRequests) -}}
{{- fail (printf "verifier.autoscaling.targetOngoingRequests (%v) is above verifier.maxOngoingRequests (%v): Serve would never scale up" $v.verifier.autoscaling.targetOngoingRequests $v.verifier.maxOngoingRequests) -}}
{{- end -}}
{{- end -}}
{{- if and $v.auth.existingSecret (include "draftmesh.chartKeys" .) -}}
{{- fail "auth: give either existingSecret or apiKeys (auth.apiKeys, auth.tenants.*.apiKeys), not both" -}}
{{- end -}}
{{- if hasKey $v.factcheck.options "redis_url" -}}
{{- fail "factcheck.options.redis_url: the Redis is set by redis.external.url or the in-chart Redis" -}}
{{- end -}}
{{- $_ := include "draftmesh.otlpEndpoint" . -}}
{{- end -}}

{{/*
The DraftmeshConfig the app is built with (serveConfigV2 applications[0].args): exactly the
sections and keys a `draftmesh serve --config` file would hold for the same settings.
*/}}
{{- define "draftmesh.meshArgs" -}}
{{- $v := .Values -}}
{{- $engine := dict "model" $v.verifier.model "device" $v.verifier.device "dtype" $v.verifier.dtype -}}
{{- $sources := dict "names" $v.sources.enabled -}}
{{- if $v.sources.options -}}
{{- $_ := set $sources "options" $v.sources.options -}}
{{- end -}}
{{- $serve := dict
  "grpc_port" $v.grpc.port
  "http_port" (ternary 8000 0 $v.http.enabled)
  "metrics_port" 8080
  "verifier_replicas" $v.verifier.replicas
  "verifier_num_gpus" $v.verifier.numGpus
  "verifier_num_cpus" $v.verifier.numCpus
  "verifier_max_ongoing" $v.verifier.maxOngoingRequests
  "router_replicas" $v.router.replicas
  "max_in_flight" $v.router.maxInFlight
  "redis_url" (include "draftmesh.redisUrl" .)
  "log_level" $v.rayService.logLevel
-}}
{{- if include "draftmesh.authEnabled" . -}}
{{- $_ := set $serve "api_keys_file" (include "draftmesh.apiKeysFile" .) -}}
{{- end -}}
{{- if $v.auth.tenants -}}
{{- $tenants := dict -}}
{{- range $name, $t := $v.auth.tenants -}}
{{- $entry := dict "share_answers_with" (default (list) $t.shareAnswersWith) -}}
{{- if not (kindIs "invalid" $t.maxInFlight) -}}{{- $_ := set $entry "max_in_flight" $t.maxInFlight -}}{{- end -}}
{{- if not (kindIs "invalid" $t.tokensPerMinute) -}}{{- $_ := set $entry "tokens_per_minute" $t.tokensPerMinute -}}{{- end -}}
{{- $_ := set $tenants $name $entry -}}
{{- end -}}
{{- $_ := set $serve "tenants" $tenants -}}
{{- end -}}
{{- $factcheck := dict "enabled" $v.factcheck.enabled "workers" 0 -}}
{{- range $key, $value := $v.factcheck.options -}}
{{- $_ := set $factcheck $key $value -}}
{{- end -}}
{{- $remote := dict -}}
{{- range $name, $spec := $v.sources.deployments -}}
{{- if $spec.enabled -}}
{{- $entry := dict "deployment" (dict "num_replicas" $spec.replicas "num_cpus" $spec.numCpus "num_gpus" $spec.numGpus) -}}
{{- if $spec.options -}}{{- $_ := set $entry "options" $spec.options -}}{{- end -}}
{{- if not (kindIs "invalid" $spec.timeoutMs) -}}{{- $_ := set $entry "timeout_ms" $spec.timeoutMs -}}{{- end -}}
{{- $_ := set $remote $name $entry -}}
{{- end -}}
{{- end -}}
{{- range $name, $spec := $v.sources.external -}}
{{- $entry := dict "address" $spec.address -}}
{{- if not (kindIs "invalid" $spec.timeoutMs) -}}{{- $_ := set $entry "timeout_ms" $spec.timeoutMs -}}{{- end -}}
{{- $_ := set $remote $name $entry -}}
{{- end -}}
{{- if $remote -}}
{{- $_ := set $sources "remote" $remote -}}
{{- end -}}
{{- $args := dict "engine" $engine "sources" $sources "serve" $serve "factcheck" $factcheck -}}
{{- /* meshConfig: the remaining fields, by section; merged into (never replacing) a section */ -}}
{{- range $section, $fields := $v.meshConfig -}}
{{- $_ := set $args $section (merge (deepCopy $fields) (get $args $section | default dict)) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* The Serve config (RayService spec.serveConfigV2). */}}
{{- define "draftmesh.serveConfig" -}}
{{- $v := .Values -}}
{{- $app := dict
  "name" "draftmesh"
  "route_prefix" "/"
  "import_path" "draftmesh.router.app:build_app"
  "args" (include "draftmesh.meshArgs" . | fromYaml)
-}}
{{- if $v.verifier.autoscaling.enabled -}}
{{- $as := $v.verifier.autoscaling -}}
{{- $autoscaling := dict
  "min_replicas" $as.minReplicas
  "max_replicas" $as.maxReplicas
  "target_ongoing_requests" $as.targetOngoingRequests
  "upscale_delay_s" $as.upscaleDelaySeconds
  "downscale_delay_s" $as.downscaleDelaySeconds
-}}
{{- $_ := set $app "deployments" (list (dict "name" "verifier" "num_replicas" "auto" "autoscaling_config" $autoscaling)) -}}
{{- end -}}
{{- $config := dict
  "proxy_location" "EveryNode"
  "http_options" (dict "host" "0.0.0.0" "port" 8000)
  "grpc_options" (dict "port" $v.grpc.port "grpc_servicer_functions" (list "draftmesh.v1.generation_pb2_grpc.add_GenerationServicer_to_server"))
  "logging_config" (dict "log_level" $v.rayService.logLevel)
  "applications" (list $app)
-}}
{{- toYaml $config -}}
{{- end -}}

{{/* env of every Ray container. */}}
{{- define "draftmesh.rayEnv" -}}
- name: REDIS_URL
  value: {{ include "draftmesh.redisUrl" . | quote }}
{{- with include "draftmesh.otlpEndpoint" . }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $.Values.tracing.otlpProtocol | quote }}
{{- end }}
{{- with .Values.rayService.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "draftmesh.rayVolumeMounts" -}}
{{- if include "draftmesh.authEnabled" . }}
- name: api-keys
  mountPath: {{ .Values.auth.mountPath | quote }}
  readOnly: true
{{- end }}
{{- if .Values.rayService.loginShellPath }}
- name: login-shell-path
  mountPath: /etc/profile.d/draftmesh-path.sh
  subPath: draftmesh-path.sh
  readOnly: true
{{- end }}
{{- end -}}

{{- define "draftmesh.rayVolumes" -}}
{{- if include "draftmesh.authEnabled" . }}
- name: api-keys
  secret:
    secretName: {{ include "draftmesh.authSecretName" . }}
    items:
      - key: {{ .Values.auth.secretKey }}
        path: {{ .Values.auth.secretKey }}
{{- end }}
{{- if .Values.rayService.loginShellPath }}
- name: login-shell-path
  configMap:
    name: {{ include "draftmesh.childName" (list . "ray-env") }}
{{- end }}
{{- end -}}

{{/* The Secret's content: the keys, one per line (a tenant's as "<tenant> <key>"). */}}
{{- define "draftmesh.apiKeysData" -}}
{{- $lines := list -}}
{{- range .Values.auth.apiKeys -}}{{- $lines = append $lines . -}}{{- end -}}
{{- range $name, $t := .Values.auth.tenants -}}
{{- range $t.apiKeys -}}{{- $lines = append $lines (printf "%s %s" $name .) -}}{{- end -}}
{{- end -}}
{{- printf "%s\n" (join "\n" $lines) -}}
{{- end -}}

{{/* The /etc/profile.d script putting the image's virtualenv first on PATH. */}}
{{- define "draftmesh.pathScript" -}}
case ":$PATH:" in
  *":{{ .Values.rayService.loginShellPath }}:"*) ;;
  *) PATH="{{ .Values.rayService.loginShellPath }}:$PATH"; export PATH ;;
esac
{{- end -}}

{{/* Pod template annotations of the Ray pods: a change of keys or of the PATH script rolls them. */}}
{{- define "draftmesh.rayPodAnnotations" -}}
{{- if and (include "draftmesh.chartKeys" .) (not .Values.auth.existingSecret) }}
checksum/api-keys: {{ include "draftmesh.apiKeysData" . | sha256sum }}
{{- end }}
{{- if .Values.rayService.loginShellPath }}
checksum/ray-env: {{ include "draftmesh.pathScript" . | sha256sum }}
{{- end }}
{{- end -}}

{{/* Ray container ports: (list $ isHead). */}}
{{- define "draftmesh.rayPorts" -}}
{{- $root := index . 0 -}}
{{- if index . 1 }}
- name: gcs-server
  containerPort: 6379
- name: dashboard
  containerPort: 8265
- name: client
  containerPort: 10001
{{- end }}
- name: metrics
  containerPort: 8080
- name: dashboard-agent
  containerPort: 52365
- name: serve
  containerPort: 8000
- name: serve-grpc
  containerPort: {{ $root.Values.grpc.port }}
{{- end -}}

{{/* Ray container probes: (list $ isHead). */}}
{{- define "draftmesh.rayProbes" -}}
{{- $root := index . 0 -}}
{{- $p := $root.Values.rayService.probes -}}
readinessProbe:
  httpGet:
    {{- if index . 1 }}
    path: /api/gcs_healthz
    port: dashboard
    {{- else }}
    path: /-/healthz
    port: serve
    {{- end }}
  initialDelaySeconds: {{ $p.initialDelaySeconds }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
livenessProbe:
  httpGet:
    path: /api/local_raylet_healthz
    port: dashboard-agent
  initialDelaySeconds: {{ $p.initialDelaySeconds }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end -}}

{{/* Render a NetworkPolicy peer list (a list of peers). */}}
{{- define "draftmesh.releasePeer" -}}
- podSelector:
    matchLabels:
      {{- include "draftmesh.releaseSelectorLabels" . | nindent 6 }}
{{- end -}}
