{{/*
Names. Every object name derives from kvtier.fullname; Kubernetes names stop at 63 characters
and the longest suffix added here is "-valkey-headless" (16), hence the 47-character cut.
*/}}
{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvtier.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.controllerName" -}}{{ include "kvtier.fullname" . }}-controller{{- end -}}
{{- define "kvtier.valkeyName" -}}{{ include "kvtier.fullname" . }}-valkey{{- end -}}
{{- define "kvtier.configName" -}}{{ include "kvtier.fullname" . }}-config{{- end -}}
{{- define "kvtier.rayClusterName" -}}{{ include "kvtier.fullname" . }}{{- end -}}

{{- define "kvtier.controllerServiceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvtier.controllerName" .) .Values.serviceAccount.controllerName -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.controllerName -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.rayServiceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-ray" (include "kvtier.fullname" .)) .Values.serviceAccount.rayName -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.rayName -}}
{{- end -}}
{{- end -}}

{{/*
Labels. Selector labels never change after install (Deployment/StatefulSet selectors are
immutable), so they hold only name, instance and component.
Call with (dict "ctx" $ "component" "controller").
*/}}
{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvtier.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvtier
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selects every Ray pod (head and workers) of this release, for NetworkPolicy peers. */}}
{{- define "kvtier.rayPodsSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "kvtier.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [ray-head, ray-worker]
{{- end -}}

{{- define "kvtier.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The controller address workers dial: the controller Service's cluster DNS name. */}}
{{- define "kvtier.controllerAddress" -}}
{{- printf "%s.%s.svc:%d" (include "kvtier.controllerName" .) .Release.Namespace (int .Values.controller.port) -}}
{{- end -}}

{{- define "kvtier.valkeySecretName" -}}
{{- default (printf "%s-valkey" (include "kvtier.fullname" .)) .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{- define "kvtier.authSecretName" -}}
{{- default (printf "%s-auth" (include "kvtier.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "kvtier.workerTokensSecretName" -}}
{{- default (printf "%s-worker-tokens" (include "kvtier.fullname" .)) .Values.auth.workerTokensSecret -}}
{{- end -}}

{{- define "kvtier.bundledRedisHost" -}}
{{- printf "%s.%s.svc" (include "kvtier.valkeyName" .) .Release.Namespace -}}
{{- end -}}

{{/*
The Redis URL when it is not secret (an external URL given in values); empty when it comes
from a Secret through the environment (the bundled Valkey always has a password).
*/}}
{{- define "kvtier.plainRedisUrl" -}}
{{- if ne .Values.redis.mode "bundled" -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Fails the render on combinations the schema cannot express. */}}
{{- define "kvtier.validate" -}}
{{- $names := list -}}
{{- range $w := (include "kvtier.workerGroups" . | fromYamlArray) -}}
{{- if or (lt (int $w.replicas) (int $w.minReplicas)) (gt (int $w.replicas) (int $w.maxReplicas)) -}}
{{- fail (printf "ray worker group %s: replicas (%d) must lie in [minReplicas (%d), maxReplicas (%d)]" $w.groupName (int $w.replicas) (int $w.minReplicas) (int $w.maxReplicas)) -}}
{{- end -}}
{{- if has $w.groupName $names -}}
{{- fail (printf "ray.workerGroups: groupName %q is used twice; give each group its own" $w.groupName) -}}
{{- end -}}
{{- $names = append $names $w.groupName -}}
{{- end -}}
{{- if eq .Values.redis.mode "external" -}}
{{- if and .Values.redis.external.url .Values.redis.external.existingSecret -}}
{{- fail "redis.external: set url or existingSecret, not both" -}}
{{- end -}}
{{- if not (or .Values.redis.external.url .Values.redis.external.existingSecret) -}}
{{- fail "redis.mode is external: set redis.external.url, or redis.external.existingSecret for a URL with a password" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.auth.enabled .Values.auth.existingSecret (not .Values.auth.workerTokensSecret) -}}
{{- fail "auth.existingSecret needs auth.workerTokensSecret: a Secret with one key per worker id, holding that worker's own token (its table entry names the id)" -}}
{{- end -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) .Values.auth.workerTokensSecret -}}
{{- fail "auth.workerTokensSecret needs auth.existingSecret: the generated token table cannot hold the digests of tokens it did not make; name both Secrets, or neither" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) -}}
{{- fail "tls.enabled needs tls.existingSecret: the name of a kubernetes.io/tls Secret" -}}
{{- end -}}
{{- if gt (mulf .Values.controller.heartbeatIntervalS 2.0) (float64 .Values.controller.leaseTtlS) -}}
{{- fail (printf "controller.heartbeatIntervalS (%v) must be at most half of controller.leaseTtlS (%v)" .Values.controller.heartbeatIntervalS .Values.controller.leaseTtlS) -}}
{{- end -}}
{{- end -}}

{{/*
Without auth.enabled, kvtier processes listening on 0.0.0.0 refuse to start unless told that
the network admits callers (kvtier/rpc/server_options.py check_exposure): here the
NetworkPolicy does. Callers include it only when auth is off.
*/}}
{{- define "kvtier.unauthenticatedEnv" -}}
- name: KVTIER_ALLOW_UNAUTHENTICATED
  value: "true"
{{- end -}}

{{/*
Worker auth settings: the table it verifies admin calls with. Each worker's own token is
/etc/kvtier/worker-tokens/<worker id> (auth.workerTokensSecret), the auth_token_file the
worker pool sets per actor, as it sets its port; the pool (--worker-tokens-dir) gives each
actor a free key of that Secret as its worker id.
*/}}
{{- define "kvtier.workerAuthEnv" -}}
{{- if .Values.auth.enabled }}
- name: KVTIER_AUTH_TOKENS_FILE
  value: /etc/kvtier/auth/tokens
{{- else }}
{{ include "kvtier.unauthenticatedEnv" . }}
{{- end }}
{{- end -}}

{{/* TLS files of every kvtier process; callers include it only when tls.enabled. */}}
{{- define "kvtier.tlsEnv" -}}
- name: KVTIER_TLS_CERT_FILE
  value: /etc/kvtier/tls/tls.crt
- name: KVTIER_TLS_KEY_FILE
  value: /etc/kvtier/tls/tls.key
- name: KVTIER_TLS_CA_FILE
  value: /etc/kvtier/tls/ca.crt
{{- end -}}

{{/*
Volumes of a kvtier container. Call with (dict "ctx" $ "role" "controller"|"worker"):
the config file is that role's TOML; the auth Secret contributes only that role's key.
*/}}
{{- define "kvtier.volumes" -}}
{{- $v := .ctx.Values -}}
- name: config
  configMap:
    name: {{ include "kvtier.configName" .ctx }}
    items:
      - key: {{ .role }}.toml
        path: config.toml
{{- if $v.auth.enabled }}
- name: auth
  secret:
    secretName: {{ include "kvtier.authSecretName" .ctx }}
    defaultMode: 0440
    items:
      # Controllers and workers verify callers with the token table (workers' own tokens
      # are a Secret of their own: worker-tokens, GPU worker pods only).
      - key: {{ $v.auth.tokensKey }}
        path: tokens
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ ternary $v.tls.existingSecret (default $v.tls.existingSecret $v.tls.workerExistingSecret) (eq .role "controller") }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "kvtier.volumeMounts" -}}
- name: config
  mountPath: /etc/kvtier/config.toml
  subPath: config.toml
  readOnly: true
{{- if .Values.auth.enabled }}
- name: auth
  mountPath: /etc/kvtier/auth
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/kvtier/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Memory of one GPU worker pod in GiB: DRAM tier for each GPU, host overhead, /dev/shm. */}}
{{- define "kvtier.workerMemoryGiB" -}}
{{- $w := .w -}}
{{- add (mul (int $w.gpusPerWorker) (int .ctx.Values.kvCache.dramGiBPerGpu)) (int $w.hostOverheadGiB) (int $w.shmGiB) -}}
{{- end -}}

{{/* NVMe volume size of one GPU worker pod in GiB: the tier for each GPU plus 1 GiB slack. */}}
{{- define "kvtier.nvmeVolumeGiB" -}}
{{- add1 (mul (int .w.gpusPerWorker) (int .ctx.Values.kvCache.nvme.gibPerGpu)) -}}
{{- end -}}

{{/* The RayCluster's worker groups as a YAML list: each ray.workerGroups entry merged over
ray.worker (its defaults), or ray.worker alone when the list is empty. */}}
{{- define "kvtier.workerGroups" -}}
{{- $groups := list -}}
{{- range (.Values.ray.workerGroups | default (list (dict))) -}}
{{- $groups = append $groups (merge (deepCopy .) (deepCopy $.Values.ray.worker)) -}}
{{- end -}}
{{- toYaml $groups -}}
{{- end -}}

{{/* Worker actors the cluster can hold at most: the sum over worker groups of maxReplicas x
gpusPerWorker (the generated worker-tokens Secret has one token per id worker-0 … worker-N-1). */}}
{{- define "kvtier.maxWorkers" -}}
{{- $n := 0 -}}
{{- range (include "kvtier.workerGroups" . | fromYamlArray) -}}
{{- $n = add $n (mul (int .maxReplicas) (int .gpusPerWorker)) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* The most GPUs (worker actors) any worker group's pod has: the port range per pod. */}}
{{- define "kvtier.maxGpusPerWorker" -}}
{{- $max := 1 -}}
{{- range (include "kvtier.workerGroups" . | fromYamlArray) -}}
{{- $max = max $max (int .gpusPerWorker) -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* Controller environment: secret-derived settings and file paths (empty by default). */}}
{{- define "kvtier.controllerEnv" -}}
{{- $c := .Values.controller -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret }}
- name: KVTIER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else if eq .Values.redis.mode "bundled" }}
- name: KVTIER_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvtier.valkeySecretName" . }}
      key: {{ .Values.redis.bundled.auth.passwordKey }}
- name: KVTIER_REDIS_URL
  value: {{ printf "redis://:$(KVTIER_REDIS_PASSWORD)@%s:%d/0" (include "kvtier.bundledRedisHost" .) (int .Values.redis.bundled.port) | quote }}
{{- end }}
{{- if .Values.auth.enabled }}
- name: KVTIER_AUTH_TOKEN_FILE
  value: /etc/kvtier/auth/tokens
{{- else }}
{{ include "kvtier.unauthenticatedEnv" . }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: KVTIER_HEALTH_PORT
  value: {{ $c.healthPort | quote }}
{{ include "kvtier.tlsEnv" . }}
{{- end }}
{{- with $c.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}
