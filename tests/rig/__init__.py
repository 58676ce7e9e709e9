"""The test rig: stand-ins for the cluster around a node, kept out of the package.

- `kube`: `FakeKube`, an in-memory Kubernetes API server behind the `kubegpu.kube.Kube`
  protocol (records calls, fails on demand, counts requests).
- `dra`: the kubelet's DRA side (plugin watcher, DRA manager, claim checkpoint, health
  streams) and a stand-in for kube-scheduler's DRA allocator, with CEL through cel-python
  (a dev dependency only).

The rig imports the package; the package never imports the rig (an import-linter contract
in pyproject.toml), so neither these modules nor cel-python ship in the wheel or the node
image. The device-plugin kubelet emulator that `kubegpu demo` runs stays in the package
(`kubegpu.kubelet`, re-exported by `kubegpu.testing`); `KubeletEmulator(dra=...)` takes
this rig's `DRAKubelet`.
"""
