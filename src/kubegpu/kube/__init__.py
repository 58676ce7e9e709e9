"""The one adapter to the Kubernetes API.

Only this package imports the Kubernetes client, lightkube (an import-linter contract says
so). Everything else talks to the small `Kube` protocol:

- `KubeClient` (`client.py`): over lightkube, one configuration per process
  (`default_client()`: in-cluster service account, else KUBECONFIG / ~/.kube/config),
  loaded on the first call, so a process that uses no API needs no credentials.
  Blocking calls, run from worker threads; the watches (a node label, the node's
  ResourceSlices) run in threads of their own.
- `KubeError` (`errors.py`): every failure, translated once: the API server's answer
  (403 -> RBAC hint, 404, 409, ...), transport trouble (unreachable, timed out) and
  missing credentials, each as one line naming the call, the object and what to do.

Tests run on an in-memory `Kube` that records calls and fails on demand: `FakeKube`, in
the repository's test rig (`tests/rig/kube.py`), not in the package.

Users: `kubegpu.events` (Node events), `kubegpu.config.source` (the node label that picks
a named config), the labeller's NodeFeature / Node patch sinks, and the DRA mode
(ResourceSlices it publishes, ResourceClaims it prepares; resource.k8s.io/v1, sent and
read schema-less, as plain dictionaries).
"""

from __future__ import annotations

from kubegpu.kube.client import KubeClient, default_client
from kubegpu.kube.errors import KubeError
from kubegpu.kube.objects import (
    NFD_GROUP,
    NFD_PLURAL,
    NFD_VERSION,
    RESOURCE_API_VERSION,
    owner_references,
)
from kubegpu.kube.protocol import RELIST, Kube, SliceEvent

__all__ = [
    "NFD_GROUP",
    "NFD_PLURAL",
    "NFD_VERSION",
    "RELIST",
    "RESOURCE_API_VERSION",
    "Kube",
    "KubeClient",
    "KubeError",
    "SliceEvent",
    "default_client",
    "owner_references",
]
