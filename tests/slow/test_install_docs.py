"""The install commands of README.md and docs/install.md work as written against this
repository: the quick start is the same in both, every version they name is the package's,
every Make target and file they name exists, every `helm` command line's values pass the
chart's schema and install the image they name, the label the quick start sets is one the
plugin's affinity selects, and the test pod is a valid Pod asking for one GPU, the same pod
as the heredoc of docs/install.md's verify step.

No cluster or registry is reached: what those would add is in docs/install.md.
"""

from __future__ import annotations

import itertools
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "kubegpu"
LOCAL_CHART = "deployments/helm/kubegpu"
README = REPO / "README.md"
INSTALL = REPO / "docs" / "install.md"
POD = REPO / "deployments" / "examples" / "gpu-pod.yaml"
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"

Doc = dict[str, Any]


def shell_blocks(document: Path) -> list[str]:
    """The ```sh and ```bash blocks of a Markdown file, continuation lines joined."""
    text = document.read_text(encoding="utf-8")
    blocks = re.findall(r"^```(?:sh|bash)\n(.*?)^```", text, re.M | re.S)
    return [block.replace("\\\n", " ") for block in blocks]


def commands(document: Path) -> list[list[str]]:
    """Every command of its shell blocks, split as the shell would; heredoc bodies and
    comments dropped, `a && b` as two commands."""
    found: list[list[str]] = []
    for block in shell_blocks(document):
        block = re.sub(r"<<EOF\n.*?^EOF$", "", block, flags=re.M | re.S)
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, "&&"]:
                if word == "&&":
                    if command:
                        found.append(command)
                    command = []
                else:
                    command.append(word)
    return found


def quick_start(document: Path) -> str:
    """The first shell block after the document's two `make` commands: the quick start."""
    return next(b for b in shell_blocks(document) if "kubectl label nodes" in b)


DOCUMENTS = [README, INSTALL]


def render(chart: Any, vals: Doc) -> list[Doc]:
    out = chart.render(vals, name="kubegpu", namespace="kube-system", is_install=True)
    return [
        d
        for t, text in sorted(out.items())
        if t.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]


def plugin(docs: list[Doc]) -> Doc:
    (found,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "kubegpu"]
    return found


def test_readme_and_install_md_give_the_same_quick_start() -> None:
    assert quick_start(README) == quick_start(INSTALL)
    lines = quick_start(INSTALL).strip().splitlines()
    assert len(lines) == 5, "the quick start is five lines: image, label, install, two checks"


def test_the_commands_parse_into_something_to_check() -> None:
    found = [c[:2] for c in commands(INSTALL)]
    for expected in (["make", "image"], ["helm", "upgrade"], ["kubectl", "wait"], ["helm", "push"]):
        assert expected in found, expected


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_version_named_is_the_packages(document: Path) -> None:
    text = "\n".join(shell_blocks(document))
    named = set(re.findall(r"(?::|--version |kubegpu-)(\d+\.\d+\.\d+)\b", text))
    named |= set(re.findall(r"image\.tag=(\S+)", text))
    assert named, f"no version found in {document.name}'s commands"
    assert named == {VERSION}, f"{document.name} names versions {named}, the package is {VERSION}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_make_target_and_file_named_exists(document: Path) -> None:
    makefile = (REPO / "Makefile").read_text()
    for command in commands(document):
        if command[0] == "make":
            for target in command[1:]:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
        paths = [w for w in command if re.match(r"(deployments|docs|src)/", w)]
        for path in paths:
            assert (REPO / path).exists(), f"{document.name}: {' '.join(command)}"


def values_of(command: list[str]) -> Doc:
    """The values of a `helm upgrade -i` command line, as Helm's own --set parser reads them."""
    vals: Doc = {}
    for option, text in itertools.pairwise(command):
        if option == "--set":
            for key, value in helm_python.parse_set_string(text).items():
                if isinstance(value, dict) and isinstance(vals.get(key), dict):
                    vals[key] = {**vals[key], **value}
                else:
                    vals[key] = value
    return vals


def helm_installs(document: Path) -> list[list[str]]:
    return [c for c in commands(document) if c[:3] == ["helm", "upgrade", "-i"]]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_helm_install_passes_the_schema_and_installs_the_image_it_names(
    chart: Any, document: Path
) -> None:
    installs = helm_installs(document)
    assert installs
    workflow = yaml.safe_load(WORKFLOW.read_text())["env"]
    published = f"{workflow['CHART_REPOSITORY']}/kubegpu"
    for command in installs:
        release, source = command[3], command[4]
        assert release == "kubegpu"
        assert source == LOCAL_CHART or source.startswith("oci://"), command
        if source.startswith("oci://ghcr.io/"):
            assert source == published, "the chart's published name is the release workflow's"
        vals = values_of(command)
        chart.validate_schema(vals)
        image = vals.get("image", {})
        repository = image.get("repository", "ghcr.io/kubegpu/kubegpu")
        tag = image.get("tag", VERSION)
        container = plugin(render(chart, vals))["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == f"{repository}:{tag}", command


def test_the_quick_start_label_is_one_the_plugin_affinity_selects(chart: Any) -> None:
    label = next(c for c in commands(INSTALL) if c[:3] == ["kubectl", "label", "nodes"])
    key, _, value = label[4].partition("=")
    affinity = plugin(render(chart, {}))["spec"]["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        all(e["key"] == key and value in e.get("values", [value]) for e in term["matchExpressions"])
        for term in terms["nodeSelectorTerms"]
    ), f"no affinity term selects {key}={value}"


def test_the_test_pod_is_a_valid_pod_that_asks_for_one_gpu() -> None:
    pod = yaml.safe_load(POD.read_text())
    kubernetes_validate.validate(pod, "1.33.0", strict=True)
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert pod["spec"]["restartPolicy"] == "Never", "the wait for Succeeded needs one run"
    name = pod["metadata"]["name"]
    waits = [c for c in commands(INSTALL) if c[:2] == ["kubectl", "wait"]]
    assert waits and all(f"pod/{name}" in c for c in waits)
    logs = [c for c in commands(INSTALL) if c[:2] == ["kubectl", "logs"]]
    assert [name] in [c[2:] for c in logs]


def test_the_verify_steps_heredoc_is_the_test_pod() -> None:
    text = INSTALL.read_text(encoding="utf-8")
    (heredoc,) = re.findall(r"<<EOF \| kubectl apply -f -\n(.*?)^EOF$", text, re.M | re.S)
    assert yaml.safe_load(heredoc) == yaml.safe_load(POD.read_text())
