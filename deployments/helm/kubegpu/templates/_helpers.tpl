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

{{/* Selector labels; pass (list $ "component"). */}}
{{- define "kubegpu.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "kubegpu.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kubegpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Name of the ConfigMap holding named configs, or "" when there is none. */}}
{{- define "kubegpu.configMapName" -}}
{{- if .Values.config.name -}}
{{- .Values.config.name -}}
{{- else if .Values.config.map -}}
{{- printf "%s-config" (include "kubegpu.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The default config name: config.default, else the only entry of config.map. */}}
{{- define "kubegpu.defaultConfig" -}}
{{- if .Values.config.default -}}
{{- .Values.config.default -}}
{{- else if eq (len (keys (default dict .Values.config.map))) 1 -}}
{{- first (keys .Values.config.map) -}}
{{- end -}}
{{- end -}}

{{/* "true" when a CDI device list strategy is chosen (string or list). */}}
{{- define "kubegpu.cdiEnabled" -}}
{{- $s := .Values.deviceListStrategy -}}
{{- $list := kindIs "slice" $s | ternary $s (list $s) -}}
{{- if or (has "cdi-annotations" $list) (has "cdi-cri" $list) -}}true{{- end -}}
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

{{/* The driver root on the host. */}}
{{- define "kubegpu.driverRoot" -}}
{{- default "/" .Values.nvidiaDriverRoot -}}
{{- end -}}

{{/* EnvVar entries for (list (list "NAME" value) ...), leaving out null values. */}}
{{- define "kubegpu.envList" -}}
{{- range . -}}
{{- $value := index . 1 -}}
{{- if not (kindIs "invalid" $value) }}
- name: {{ index . 0 }}
  value: {{ kindIs "slice" $value | ternary (join "," $value) (toString $value) | quote }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when MIG devices may be served: migStrategy, or a named config, is single/mixed. */}}
{{- define "kubegpu.migEnabled" -}}
{{- if has (toString .Values.migStrategy) (list "single" "mixed") -}}true
{{- else -}}
{{- range $name, $text := .Values.config.map -}}
{{- $cfg := fromYaml $text -}}
{{- if and $cfg.flags (kindIs "map" $cfg.flags) (has (toString $cfg.flags.migStrategy) (list "single" "mixed")) -}}true{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The plugin container's securityContext. compatWithCPUManager needs privileged: it passes
every /dev/nvidia* node, which an unprivileged container cannot see. MIG needs
CAP_SYS_ADMIN: NVML only delivers MIG health events (via /dev/nvidia-caps) to it.
Everything else runs with no capability at all.
*/}}
{{- define "kubegpu.securityContext" -}}
{{- if eq .Values.compatWithCPUManager true -}}
privileged: true
{{- else -}}
{{- $sc := deepCopy (default dict .Values.securityContext) -}}
{{- if include "kubegpu.migEnabled" . -}}
{{- $caps := default dict $sc.capabilities -}}
{{- $_ := set $caps "add" (uniq (append (default (list) $caps.add) "SYS_ADMIN")) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}
{{- end -}}
