#!/usr/bin/env python3
"""Render `deployments/static/*.yaml` from the Helm chart: `python deployments/render-static.py`.

The static manifests are for clusters that do not use Helm (`kubectl apply -f`). They
are generated, never edited by hand, so they cannot drift from the chart; a unit test
(`tests/slow/test_helm.py`) fails when they are out of date. `--check` exits 1 instead
of writing when a file would change.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parent
CHART = ROOT / "helm" / "kubegpu"
STATIC = ROOT / "static"
RELEASE = "kubegpu"
NAMESPACE = "kube-system"

#: Output file -> values scenario (a file under the chart's ci/ directory).
OUTPUTS = {
    "kubegpu.yaml": "defaults-values.yaml",
    "kubegpu-labeller.yaml": "labeller-static-values.yaml",
}
#: Helm bookkeeping labels that would be false on objects applied with kubectl.
_HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
_KIND_ORDER = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def render(values_file: str) -> str:
    values = yaml.safe_load((CHART / "ci" / values_file).read_text(encoding="utf-8")) or {}
    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for template in sorted(rendered):
        if not template.endswith(".yaml"):
            continue  # NOTES.txt
        docs.extend(d for d in yaml.safe_load_all(rendered[template]) if d)
    for doc in docs:
        labels = doc.get("metadata", {}).get("labels", {})
        for key in _HELM_LABELS:
            labels.pop(key, None)
    # RBAC and accounts first, so `kubectl apply -f` never starts a pod without them.
    docs.sort(key=lambda d: (_rank(d["kind"]), d["kind"], d["metadata"]["name"]))
    header = (
        "# Generated from deployments/helm/kubegpu by deployments/render-static.py"
        f" (values: ci/{values_file}).\n# Do not edit: change the chart and re-run the script.\n"
    )
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=1000) for d in docs)
    return header + "---\n" + body


def _rank(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)


def render_all() -> dict[str, str]:
    """Output file name -> its content."""
    return {name: render(values) for name, values in OUTPUTS.items()}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, text in render_all().items():
        path = STATIC / name
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT.parent)}")
    if check and stale:
        print(f"out of date: {', '.join(stale)}; run python deployments/render-static.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
