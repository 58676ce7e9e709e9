"""GPU Feature Discovery's job: label the node with its GPUs, again and again.

- `kubegpu.labeller.loop`: `run_labeller` (compute with `kubegpu.labels`, publish,
  sleep), the config it reads on each pass (`config_loader`, `LiveConfig`; the named
  configs are chosen as `serve` chooses them, `kubegpu.config.source.named_configs`,
  re-exported here) and the backend it opens on each pass (`discoverer`); and
  `follow_store`, `serve --with-labels`: the labels of the daemon's `NodeStore`, again on
  every change of it;
- `kubegpu.labeller.sinks`: where labels go (features.d file, NodeFeature, Node patch),
  the last two through the one Kubernetes adapter, `kubegpu.kube`.

The `kubegpu labels` command (GFD's flags and env vars) is `kubegpu.cli.labels`. The
labeller reads the host through `kubegpu.devices` (the only package that reads sysfs):
`devices.pci` for the bus, `devices.host.read_machine_type` (re-exported here, where
the commands that label find it) for `gpu.machine`.
"""

from kubegpu.config.source import named_configs
from kubegpu.devices.host import read_machine_type
from kubegpu.labeller.loop import (
    VENDOR_LABELS,
    LiveConfig,
    VendorLabels,
    config_loader,
    discoverer,
    follow_store,
    parse_duration,
    run_labeller,
    run_until_signalled,
)
from kubegpu.labeller.sinks import (
    MANAGED_ANNOTATION,
    FeatureFileSink,
    LabelSink,
    NodeFeatureSink,
    NodePatchSink,
    PublishError,
    format_features,
    owner_references,
    write_atomically,
)

__all__ = [
    "MANAGED_ANNOTATION",
    "VENDOR_LABELS",
    "FeatureFileSink",
    "LabelSink",
    "LiveConfig",
    "NodeFeatureSink",
    "NodePatchSink",
    "PublishError",
    "VendorLabels",
    "config_loader",
    "discoverer",
    "follow_store",
    "format_features",
    "named_configs",
    "owner_references",
    "parse_duration",
    "read_machine_type",
    "run_labeller",
    "run_until_signalled",
    "write_atomically",
]
