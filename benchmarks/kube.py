"""What the Kubernetes adapter costs, and when: at import (nothing) and on the first call.

Each trial is a fresh interpreter (imports are cached per process). It imports what
`serve` imports for events and the node-label watch, then makes the process's one client
load a kubeconfig (pointing at a closed port: no request is sent), and prints the time
and RSS of both steps. Run: `python -m benchmarks.kube`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRIALS = 5

_CHILD = """
import json, sys, time

def rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")

start_rss, start = rss_mib(), time.perf_counter()
import kubegpu.config.source, kubegpu.events
from kubegpu.kube import default_client
client = default_client()
imported_rss, imported = rss_mib(), time.perf_counter()
client_at_start = "kubernetes" in sys.modules
client.connect()
connected_rss, connected = rss_mib(), time.perf_counter()
print(json.dumps({
    "import_ms": (imported - start) * 1000,
    "import_mib": imported_rss - start_rss,
    "client_at_start": client_at_start,
    "connect_ms": (connected - imported) * 1000,
    "connect_mib": connected_rss - imported_rss,
}))
"""


def _kubeconfig(path: Path) -> None:
    cluster = {"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}
    context = {"name": "x", "context": {"cluster": "c", "user": "u"}}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [context],
        "current-context": "x",
    }
    path.write_text(json.dumps(config), encoding="utf-8")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kgkube-") as work:
        kubeconfig = Path(work) / "kubeconfig"
        _kubeconfig(kubeconfig)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
        env["KUBECONFIG"] = str(kubeconfig)
        runs = []
        for _ in range(TRIALS):
            done = subprocess.run(
                [sys.executable, "-c", _CHILD],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            )
            runs.append(json.loads(done.stdout))
    figures = {
        key: round(statistics.median(run[key] for run in runs), 1)
        for key in ("import_ms", "import_mib", "connect_ms", "connect_mib")
    }
    figures["client_imported_at_start"] = any(run["client_at_start"] for run in runs)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
