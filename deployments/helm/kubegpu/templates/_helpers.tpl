{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kubegpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix: <release>-<chart>, or the release name when it already says kubegpu. */}}
{{- define "kubegpu.fullname" -}}
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

{{- define "kubegpu.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "kubegpu.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kubegpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Selector labels; pass (list $ "component"). selectorLabelsOverride (NVIDIA's value) replaces
name/instance, e.g. to keep the selector of an existing DaemonSet; the component label stays
so the plugin's and the labeller's DaemonSets never select each other's pods.
*/}}
{{- define "kubegpu.selectorLabels" -}}
{{- $ := index . 0 -}}
{{- if $.Values.selectorLabelsOverride -}}
{{ toYaml $.Values.selectorLabelsOverride }}
{{- else -}}
app.kubernetes.io/name: {{ include "kubegpu.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
{{- end }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Pod labels: the selector labels plus name/instance (as NVIDIA's templateLabels). */}}
{{- define "kubegpu.podLabels" -}}
{{- $ := index . 0 -}}
{{- $labels := dict "app.kubernetes.io/name" (include "kubegpu.name" $) "app.kubernetes.io/instance" $.Release.Name -}}
{{- $labels = merge (fromYaml (include "kubegpu.selectorLabels" .)) $labels -}}
{{- toYaml $labels -}}
{{- end -}}

{{/*
The image. A repository named k8s-device-plugin is NVIDIA's image (a values file copied from
NVIDIA's chart carries nvcr.io/nvidia/k8s-device-plugin): it has no kubegpu in it, so the
pods would never start. kubegpu's own image is used instead and NOTES.txt says so.
*/}}
{{- define "kubegpu.nvidiaImage" -}}
{{- if eq (last (splitList "/" .Values.image.repository)) "k8s-device-plugin" -}}true{{- end -}}
{{- end -}}

{{- define "kubegpu.image" -}}
{{- if include "kubegpu.nvidiaImage" . -}}
{{- printf "ghcr.io/kubegpu/kubegpu:%s" .Chart.AppVersion -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Name of the ConfigMap holding named configs, or "" when there is none. */}}
{{- define "kubegpu.configMapName" -}}
{{- if .Values.config.name -}}
{{- .Values.config.name -}}
{{- else if .Values.config.map -}}
{{- printf "%s-config" (include "kubegpu.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
DEFAULT_CONFIG, "" for none. NVIDIA's config-manager takes, for a node without the config
label, config.default, else the first fallback that finds a config (`named`: the one called
"default"; `single`: the only one; `empty`: none). kubegpu's plugin takes DEFAULT_CONFIG at
its `named` step instead, so the chart hands it the config NVIDIA's would pick:
config.default; else, with config.map (whose names it knows), the fallback walk done here,
stopping where `empty` would stop it; else, with config.name, "default" when `named` is a
fallback (null strategies are named then single), which makes `named` look for "default".
*/}}
{{- define "kubegpu.defaultConfig" -}}
{{- $map := default dict .Values.config.map -}}
{{- $strategies := .Values.config.fallbackStrategies -}}
{{- if kindIs "invalid" $strategies -}}{{- $strategies = list "named" "single" -}}{{- end -}}
{{- $found := "" -}}
{{- $stopped := false -}}
{{- if .Values.config.default -}}
{{- $found = .Values.config.default -}}
{{- else if .Values.config.map -}}
{{- range $strategies -}}
{{- if not (or $found $stopped) -}}
{{- if and (eq . "named") (hasKey $map "default") -}}{{- $found = "default" -}}{{- end -}}
{{- if and (eq . "single") (eq (len $map) 1) -}}{{- $found = first (keys $map) -}}{{- end -}}
{{- if eq . "empty" -}}{{- $stopped = true -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- else if has "named" $strategies -}}
{{- $found = "default" -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/*
FALLBACK_STRATEGIES, comma-separated; "" leaves the binary's default (named then single).
The user's list, except that with a config.default `named` goes first: NVIDIA's
config-manager takes config.default before any fallback, kubegpu's plugin at `named`.
*/}}
{{- define "kubegpu.fallbackStrategies" -}}
{{- $s := .Values.config.fallbackStrategies -}}
{{- if not (kindIs "invalid" $s) -}}
{{- if and .Values.config.default (or (not $s) (ne (index $s 0) "named")) -}}
{{- $s = prepend (without $s "named") "named" -}}
{{- end -}}
{{- join "," $s -}}
{{- end -}}
{{- end -}}

{{/* The parsed configs of config.map, as a YAML list (unparseable entries are skipped). */}}
{{- define "kubegpu.configs" -}}
{{- $out := list -}}
{{- range $name, $text := .Values.config.map -}}
{{- $cfg := fromYaml $text -}}
{{- if not (hasKey $cfg "Error") -}}{{- $out = append $out $cfg -}}{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
"true" when the device list strategies (deviceListStrategy, else each named config's
flags.plugin.deviceListStrategy) may include one of the strategies passed in; an external
ConfigMap (config.name) may hold any, so it counts as yes, as in NVIDIA's chart.
Pass (list $ (list "strategy" ...)).
*/}}
{{- define "kubegpu.listStrategyMayInclude" -}}
{{- $ := index . 0 -}}
{{- $wanted := index . 1 -}}
{{- $found := false -}}
{{- $s := $.Values.deviceListStrategy -}}
{{- if not (kindIs "invalid" $s) -}}
{{- $found = include "kubegpu.strategyListHas" (list $s $wanted) -}}
{{- else if $.Values.config.name -}}
{{- $found = true -}}
{{- else -}}
{{- range (fromYamlArray (include "kubegpu.configs" $)) -}}
{{- $plugin := dig "flags" "plugin" dict . -}}
{{- if and (kindIs "map" $plugin) (include "kubegpu.strategyListHas" (list (dig "deviceListStrategy" nil $plugin) $wanted)) -}}
{{- $found = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $found -}}true{{- end -}}
{{- end -}}

{{/* "true" when a strategy value (a list, or a comma-separated string) has one of the wanted. */}}
{{- define "kubegpu.strategyListHas" -}}
{{- $s := index . 0 -}}
{{- $items := list -}}
{{- if kindIs "slice" $s -}}{{- $items = $s -}}{{- else if kindIs "string" $s -}}{{- $items = splitList "," $s -}}{{- end -}}
{{- range $items -}}
{{- if has (trim (toString .)) (index $ 1) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when a CDI strategy may be on: the plugin then writes CDI specs to /var/run/cdi. */}}
{{- define "kubegpu.cdiEnabled" -}}
{{- include "kubegpu.listStrategyMayInclude" (list . (list "cdi-annotations" "cdi-cri")) -}}
{{- end -}}

{{/* "true" when MPS mounts are needed: forced, or a named config uses sharing.mps. */}}
{{- define "kubegpu.mpsEnabled" -}}
{{- if kindIs "bool" .Values.mps.enabled -}}
{{- if .Values.mps.enabled -}}true{{- end -}}
{{- else -}}
{{- range $name, $text := .Values.config.map -}}
{{- $cfg := fromYaml $text -}}
{{- if and $cfg.sharing (kindIs "map" $cfg.sharing) $cfg.sharing.mps -}}true{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
DRA mode: the driver name this release's pods serve under, as `serve --mode dra` picks it
from the node's GPUs: gpu.amd.com with backend=amd, else NVIDIA's gpu.nvidia.com (the
DeviceClasses of deviceclasses.yaml follow the same rule). It names the plugin's own
directory under dra.kubeletPluginsDirectoryPath and the slices the admission policy lets
it write.
*/}}
{{- define "kubegpu.draDriver" -}}
{{- ternary "gpu.amd.com" "gpu.nvidia.com" (eq (toString .Values.backend) "amd") -}}
{{- end -}}

{{/*
Host path to mount read-only at /driver-root, or "" for none. As in NVIDIA's chart the host's
driver root is mounted only when nvidiaDriverRoot names one (the GPU Operator's
/run/nvidia/driver); with the driver on the host itself the NVIDIA runtime hands the
container NVML (the image sets NVIDIA_VISIBLE_DEVICES=all), so the host's `/` is mounted
only for CDI, whose spec lists the driver's files as the host has them.
Pass (list $ "plugin"|"labeller").
*/}}
{{- define "kubegpu.driverRootMount" -}}
{{- $ := index . 0 -}}
{{- $root := $.Values.nvidiaDriverRoot -}}
{{- if and $root (ne (clean $root) "/") -}}
{{- $root -}}
{{- else if and (eq (index . 1) "plugin") (include "kubegpu.cdiEnabled" $) -}}
/
{{- end -}}
{{- end -}}

{{/*
A container's env. Pass (list $pairs $downward $user): the chart's (list "NAME" value)
pairs, null values left out; the downward-API variables as (list "NAME" "fieldPath"); then
the user's EnvVar list (extraEnv, gfd.env). A name the user gives replaces the chart's
entry instead of repeating it: the API server warns about a repeated name, and which of
two entries applies is easy to misread.
*/}}
{{- define "kubegpu.containerEnv" -}}
{{- $user := default list (index . 2) -}}
{{- $taken := list -}}
{{- range $user -}}{{- $taken = append $taken .name -}}{{- end -}}
{{- range (index . 0) -}}
{{- $value := index . 1 -}}
{{- if and (not (kindIs "invalid" $value)) (not (has (index . 0) $taken)) }}
- name: {{ index . 0 }}
  value: {{ kindIs "slice" $value | ternary (join "," $value) (toString $value) | quote }}
{{- end -}}
{{- end -}}
{{- range (index . 1) -}}
{{- if not (has (index . 0) $taken) }}
- name: {{ index . 0 }}
  valueFrom:
    fieldRef:
      fieldPath: {{ index . 1 }}
{{- end -}}
{{- end -}}
{{- with $user }}
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{/*
How the labeller's labels reach the Node when that goes through Node Feature Discovery:
"a features.d file" or "NodeFeature objects"; "" when the labeller is off or patches Nodes.
*/}}
{{- define "kubegpu.nfdDelivery" -}}
{{- if and .Values.gfd.enabled (not .Values.gfd.nodePatch) -}}
{{- if .Values.gfd.useNodeFeatureAPI -}}NodeFeature objects{{- else -}}a features.d file{{- end -}}
{{- end -}}
{{- end -}}

{{/*
"true" when MIG devices may be served, as NVIDIA's chart decides: migStrategy when set;
else an external ConfigMap (config.name) may enable MIG; else a named config in config.map
with flags.migStrategy single or mixed (kubegpu reads them: NVIDIA assumes any config may).
*/}}
{{- define "kubegpu.migEnabled" -}}
{{- if .Values.migStrategy -}}
{{- if ne (toString .Values.migStrategy) "none" -}}true{{- end -}}
{{- else if .Values.config.name -}}
true
{{- else -}}
{{- range (fromYamlArray (include "kubegpu.configs" .)) -}}
{{- if has (toString (dig "flags" "migStrategy" "" .)) (list "single" "mixed") -}}true{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
"true" when the plugin needs CAP_SYS_ADMIN, where NVIDIA's chart adds it: MIG (NVML delivers
MIG health events through /dev/nvidia-caps only to it) and the volume-mounts strategy.
*/}}
{{- define "kubegpu.needsSysAdmin" -}}
{{- if or (include "kubegpu.migEnabled" .) (include "kubegpu.listStrategyMayInclude" (list . (list "volume-mounts"))) -}}true{{- end -}}
{{- end -}}

{{/*
The plugin container's securityContext, with NVIDIA's precedence: a non-empty
securityContext value is used as given; else compatWithCPUManager runs privileged (it must
see and pass every /dev/nvidia* node); else least privilege: no capability (SYS_ADMIN
where needed, above), no privilege escalation, a read-only root filesystem.
*/}}
{{- define "kubegpu.securityContext" -}}
{{- if .Values.securityContext -}}
{{- toYaml .Values.securityContext -}}
{{- else if eq .Values.compatWithCPUManager true -}}
privileged: true
{{- else -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
  {{- if include "kubegpu.needsSysAdmin" . }}
  add: ["SYS_ADMIN"]
  {{- end }}
{{- end -}}
{{- end -}}

{{/*
The labeller's GFD_SLEEP_INTERVAL, "" when unset: gfd.sleepInterval, else NVIDIA's top-level
sleepInterval. A number is nanoseconds, as in a config file's sleepInterval; it is written
with a unit because the flag, like Go's time.ParseDuration, takes none without (a negative
one relabels without pause, as Go's timer does: 0s). Go's one unitless duration, "0", is
written 0s for the same reason.
*/}}
{{- define "kubegpu.sleepInterval" -}}
{{- $v := .Values.gfd.sleepInterval -}}
{{- if kindIs "invalid" $v -}}{{- $v = .Values.sleepInterval -}}{{- end -}}
{{- if or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- if gt (int64 $v) 0 -}}{{- printf "%dns" (int64 $v) -}}{{- else -}}0s{{- end -}}
{{- else if and (kindIs "string" $v) (regexMatch "^[-+]?0$" (toString $v)) -}}
0s
{{- else if not (kindIs "invalid" $v) -}}
{{- $v -}}
{{- end -}}
{{- end -}}

{{/* The labeller's securityContext: gfd.securityContext as given, else least privilege. */}}
{{- define "kubegpu.labellerSecurityContext" -}}
{{- if .Values.gfd.securityContext -}}
{{- toYaml .Values.gfd.securityContext -}}
{{- else -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
{{- end -}}

{{/*
Default container resources, from the measured RSS (docs/performance.md: `serve` 57 MiB,
69 MiB once the kubernetes client is loaded; `kubegpu labels` 50-64 MiB) with room for
1,000+ devices and allocation bursts. No memory limit while MPS runs: the control daemons
and the MPS servers they start live in the plugin's cgroup and grow with GPUs and clients.
Pass (list $ "plugin"|"labeller").
*/}}
{{- define "kubegpu.resources" -}}
{{- $ := index . 0 -}}
{{- $given := ternary $.Values.resources $.Values.gfd.resources (eq (index . 1) "plugin") -}}
{{- if $given -}}
{{- toYaml $given -}}
{{- else -}}
requests:
  cpu: 10m
  memory: 96Mi
{{- if not (and (eq (index . 1) "plugin") (include "kubegpu.mpsEnabled" $)) }}
limits:
  memory: 256Mi
{{- end }}
{{- end -}}
{{- end -}}

{{/*
Keys of NVIDIA's values that kubegpu accepts but cannot act on, one "key: why" per line;
NOTES.txt prints them so a copied values file never fails silently.
*/}}
{{- define "kubegpu.ignoredValues" -}}
{{- if omit (default dict .Values.nfd) "enabled" }}
nfd.*: settings of NVIDIA's Node Feature Discovery subchart; kubegpu deploys no NFD, so they configure nothing (install NFD yourself, or set gfd.nodePatch=true to label Nodes without it)
{{- end }}
{{- with .Values.cdi }}
{{- if .featureFlags }}
cdi.featureFlags: kubegpu's CDI specs have no feature flags
{{- end }}
{{- end }}
{{- if .Values.gfd.nameOverride }}
gfd.nameOverride: no effect (nor in NVIDIA's chart since GFD stopped being a subchart)
{{- end }}
{{- if .Values.gfd.namespaceOverride }}
gfd.namespaceOverride: no effect (nor in NVIDIA's chart); the labeller runs in namespaceOverride or the release namespace
{{- end }}
{{- end -}}
