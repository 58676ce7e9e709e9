"""The container image definition, checked without Docker."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import kubegpu

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deployments" / "container" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_every_copy_source_exists_in_the_repository() -> None:
    copies = [args for word, args in instructions() if word == "COPY"]
    assert copies
    for args in copies:
        parts = args.split()
        if any(p.startswith("--from=") for p in parts):
            continue  # from another stage, not the build context
        sources = [p for p in parts if not p.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY source {source} is not in the repo"


def test_base_images_are_pinned() -> None:
    stages = [args.split()[0] for word, args in instructions() if word == "FROM"]
    assert len(stages) >= 2, "expected a multi-stage build"
    for image in stages:
        if "@sha256:" in image:
            continue
        tag = image.partition(":")[2]
        assert tag, f"{image} has no tag"
        assert re.match(r"^\d+\.\d+\.\d+-", tag), f"{image}: pin an exact patch release"
        assert tag != "latest"
    assert stages[-1].startswith("python:3.11") and "slim" in stages[-1]


def test_entrypoint_is_the_declared_console_script() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["kubegpu"] == "kubegpu.cli:main"
    cmds = dict(instructions())
    # Through coreutils' env, which ignores SIGHUP before the interpreter starts.
    assert cmds["ENTRYPOINT"] == '["env", "--ignore-signal=HUP", "kubegpu"]'
    assert cmds["CMD"] == '["serve"]'
    # The console script lands on PATH through the copied virtual environment.
    assert "/opt/kubegpu/bin" in cmds["ENV"]


def test_version_label_matches_the_package() -> None:
    labels = " ".join(args for word, args in instructions() if word == "LABEL")
    match = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', labels)
    assert match, "no OCI version label"
    assert match[1] == kubegpu.__version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == kubegpu.__version__


def test_final_stage_ships_only_the_environment_and_has_a_non_root_user() -> None:
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    final = ins[last_from:]
    copies = [args for word, args in final if word == "COPY"]
    assert copies == ["--from=builder /opt/kubegpu /opt/kubegpu"]
    assert any(word == "RUN" and "useradd" in args and "65532" in args for word, args in final)


def test_chart_image_and_app_version_follow_the_package() -> None:
    chart = (REPO / "deployments" / "helm" / "kubegpu" / "Chart.yaml").read_text()
    assert f'appVersion: "{kubegpu.__version__}"' in chart


def test_the_image_builds_no_compiled_code() -> None:
    """kubegpu is pure Python: no C compiler in any stage, no extension to build or check,
    no setup.py beside pyproject.toml, no C source in the package."""
    ins = instructions()
    runs = " ".join(args for word, args in ins if word == "RUN")
    assert not re.search(r"\b(gcc|g\+\+|clang|build-essential|libc6-dev|python3-dev)\b", runs)
    assert "_idscan" not in runs
    copied = " ".join(args for word, args in ins if word == "COPY").split()
    assert "setup.py" not in copied
    assert not (REPO / "setup.py").exists()
    assert not [p for p in (REPO / "src").rglob("*") if p.suffix in {".c", ".h", ".pyx", ".so"}]


def test_the_builder_installs_exactly_the_locked_versions() -> None:
    """The image gets the versions `make venv` and CI test: pip, the wheel's build
    dependencies and every runtime package come from requirements.lock."""
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    builder = ins[:last_from]
    copied = " ".join(args for word, args in builder if word == "COPY").split()
    assert "requirements.lock" in copied
    runs = " && ".join(args for word, args in builder if word == "RUN")
    commands = [c.strip() for c in runs.split("&&")]
    pips = [c for c in commands if re.search(r"\bpip (install|wheel)\b", c)]
    assert any(c.endswith("pip install -c requirements.lock pip") for c in pips)
    assert any("pip install -c requirements.lock /dist/kubegpu-" in c for c in pips)
    for command in pips:
        if " wheel " in f" {command} ":
            assert "--build-constraint requirements.lock" in command, command
            assert "--no-deps" in command, command
        else:
            assert "-c requirements.lock" in command, command


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _imported_by_the_package() -> set[str]:
    """The top-level names `src/kubegpu` imports (absolute imports only)."""
    found: set[str] = set()
    for path in (REPO / "src" / "kubegpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return found


def test_the_image_carries_the_runtime_dependencies_and_nothing_only_tests_use() -> None:
    """The builder installs the wheel alone (no extra, no requirements file: the lock is
    constraints only), so the image holds the wheel's runtime dependencies; those name
    every package the package imports and nothing else. cel-python, the CEL library of the
    test rig's scheduler stand-in (tests/rig/dra), is a dev dependency, still locked."""
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    runs = " && ".join(args for word, args in ins[:last_from] if word == "RUN")
    installs = [c.strip() for c in runs.split("&&") if re.search(r"\bpip install\b", c)]
    [wheel] = [c for c in installs if "/dist/" in c]
    assert wheel.split()[-1] == "/dist/kubegpu-*.whl", (
        f"the wheel is installed with extras: {wheel}"
    )
    for command in installs:
        assert not re.search(r"(^|\s)(-r|--requirement|-e|--editable)\b", command), command

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = _names(pyproject["dependencies"])
    dev = _names(pyproject["optional-dependencies"]["dev"])
    assert "cel-python" not in runtime, "the node image would carry the test rig's CEL"
    assert "cel-python" in dev
    lock = (REPO / "requirements.lock").read_text()
    assert re.search(r"^cel-python==", lock, re.MULTILINE), "make lock: cel-python is unpinned"

    distributions: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            distributions.setdefault(canonicalize_name(dist), set()).add(module)
    imported = _imported_by_the_package()
    unused = sorted(d for d in runtime if not distributions.get(d, set()) & imported)
    assert not unused, f"runtime dependencies the package never imports: {unused}"
