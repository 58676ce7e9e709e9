{{/*
Unknown values, refused with a suggestion: `unknown value 'gfd.enabeld'; did you mean
'gfd.enabled'?`. Helm checks values.schema.json before any template runs, and a schema can
only say "additional properties 'gfd.enabeld' not allowed", so the schema types the known
values and this check refuses the others (templates/validation.yaml runs it first).
*/}}

{{/*
The chart's values as values.schema.json lists them (tests/slow/test_helm.py holds the two
equal): a key with keys under it is an object whose own keys are checked too; any other
takes any value (Kubernetes data, maps of names, NVIDIA's nfd.* subchart settings).
*/}}
{{- define "kubegpu.knownValues" -}}
nameOverride:
fullnameOverride:
namespaceOverride:
selectorLabelsOverride:
allowDefaultNamespace:
namespace:
config:
  name:
  map:
  default:
  fallbackStrategies:
  nodeLabel:
migStrategy:
failOnInitError:
deviceListStrategy:
deviceIDStrategy:
passDeviceSpecs:
nvidiaDriverRoot:
nvidiaDevRoot:
gdsEnabled:
mofedEnabled:
gdrcopyEnabled:
nvidiaCTKPath:
cdi:
  nvidiaHookPath:
  featureFlags:
cdiAnnotationPrefix:
compatWithCPUManager:
deviceDiscoveryStrategy:
simulate:
backend:
resourceNamingStrategy:
devicePluginPath:
mode:
dra:
  deviceClasses:
  extendedResourceNames:
  kubeletRegistrarDirectoryPath:
  kubeletPluginsDirectoryPath:
  sliceAdmissionPolicy:
mps:
  enabled:
  root:
  enableHostPID:
  enableHostNetwork:
image:
  repository:
  tag:
  pullPolicy:
imagePullSecrets:
updateStrategy:
handover:
  enabled:
podAnnotations:
podSecurityContext:
securityContext:
resources:
nodeSelector:
affinity:
tolerations:
priorityClassName:
runtimeClassName:
devicePlugin:
  enabled:
  enableHostNetwork:
gfd:
  enabled:
  noTimestamp:
  sleepInterval:
  useNodeFeatureAPI:
  nodePatch:
  featuresDir:
  failOnInitError:
  resources:
  securityContext:
  nodeSelector:
  affinity:
  nameOverride:
  namespaceOverride:
  enableHostNetwork:
  env:
metrics:
  enabled:
  port:
  address:
  serviceMonitor:
    enabled:
    interval:
    additionalLabels:
    honorLabels:
  prometheusRule:
    enabled:
    additionalLabels:
    runbookUrl:
    nearMemoryLimit:
      threshold:
      for:
      severity:
    gpuUnhealthy:
      for:
      severity:
    gpuLost:
      window:
      for:
      severity:
    staleResource:
      for:
      severity:
  grafanaDashboard:
    enabled:
    namespace:
    label:
    labelValue:
    additionalLabels:
    annotations:
probes:
  port:
  liveness:
    enabled:
    periodSeconds:
    failureThreshold:
  readiness:
    enabled:
    periodSeconds:
    failureThreshold:
serviceAccount:
  create:
  annotations:
logFormat:
extraEnv:
global:
noTimestamp:
sleepInterval:
nfd:
{{- end -}}

{{/*
Each unknown key under (list VALUES KNOWN PREFIX), one a line: its path, a tab, and the
path of a known key at the same place that is close to it (or nothing).
*/}}
{{- define "kubegpu.unknownValues" -}}
{{- $known := index . 1 -}}
{{- $at := index . 2 -}}
{{- range $key, $value := index . 0 -}}
{{- if hasKey $known $key -}}
{{- $inner := index $known $key -}}
{{- if and (kindIs "map" $inner) (kindIs "map" $value) -}}
{{- include "kubegpu.unknownValues" (list $value $inner (printf "%s%s." $at $key)) -}}
{{- end -}}
{{- else -}}
{{- $near := include "kubegpu.closestKey" (list $key (keys $known | sortAlpha)) }}
{{ $at }}{{ $key | trunc 80 }}{{ "\t" }}{{ with $near }}{{ $at }}{{ . }}{{ end }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The key of (list KEY KNOWN) closest to KEY: a slip of case, or at most a third of its
letters wrong (two for a short key); empty when none is that close.
*/}}
{{- define "kubegpu.closestKey" -}}
{{- $key := index . 0 -}}
{{- $best := "" -}}
{{- $distance := 1000 -}}
{{- range $candidate := index . 1 -}}
{{- $d := include "kubegpu.editDistance" (list $key $candidate) | atoi -}}
{{- if lt $d $distance -}}
{{- $best = $candidate -}}
{{- $distance = $d -}}
{{- end -}}
{{- end -}}
{{- if le $distance (max 2 (div (len $key) 3)) -}}{{ $best }}{{- end -}}
{{- end -}}

{{/*
Levenshtein distance between the two strings of (list A B), case ignored: one row of the
table at a time, each cell the cheapest of a deletion, an insertion or a substitution.
*/}}
{{- define "kubegpu.editDistance" -}}
{{- $a := splitList "" (lower (index . 0)) -}}
{{- $b := splitList "" (lower (index . 1)) -}}
{{- $row := until (int (add1 (len $b))) -}}
{{- range $i, $ca := $a -}}
{{- $next := list (add1 $i) -}}
{{- range $j, $cb := $b -}}
{{- $swap := add (index $row $j) (ternary 0 1 (eq $ca $cb)) -}}
{{- $next = append $next (min (add1 (index $row (add1 $j))) (add1 (last $next)) $swap) -}}
{{- end -}}
{{- $row = $next -}}
{{- end -}}
{{- last $row -}}
{{- end -}}

{{/*
Fails the install naming every unknown value, with a suggestion where one is close.
*/}}
{{- define "kubegpu.checkValues" -}}
{{- $known := fromYaml (include "kubegpu.knownValues" .) -}}
{{- $found := include "kubegpu.unknownValues" (list .Values $known "") | trimAll "\n" -}}
{{- if $found -}}
{{- $lines := splitList "\n" $found -}}
{{- $help := "see the chart's values.yaml (helm show values)" -}}
{{- if eq (len $lines) 1 -}}
{{- $parts := splitList "\t" (first $lines) -}}
{{- if last $parts -}}
{{- fail (printf "unknown value '%s'; did you mean '%s'?" (first $parts) (last $parts)) -}}
{{- end -}}
{{- fail (printf "unknown value '%s': this chart has no such value; %s" (first $parts) $help) -}}
{{- end -}}
{{- $items := list -}}
{{- range $lines -}}
{{- $parts := splitList "\t" . -}}
{{- $item := printf "'%s'" (first $parts) -}}
{{- if last $parts -}}
{{- $item = printf "%s (did you mean '%s'?)" $item (last $parts) -}}
{{- end -}}
{{- $items = append $items $item -}}
{{- end -}}
{{- fail (printf "unknown values %s; %s" (join ", " $items) $help) -}}
{{- end -}}
{{- end -}}
