"""requirements.lock: one set of exact versions for `make venv`, CI and the container image."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[3]
LOCK = REPO / "requirements.lock"
MAKEFILE = REPO / "Makefile"


def locked() -> dict[str, Requirement]:
    """The lock's pins by canonical name (comment lines and `# via` notes dropped)."""
    pins: dict[str, Requirement] = {}
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        line = line.partition("#")[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins


def pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req}: the lock pins exact versions"
    return spec.version


def declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["dev"]]]


def test_every_pin_is_exact() -> None:
    pins = locked()
    assert pins
    for req in pins.values():
        pinned_version(req)


def test_every_declared_dependency_is_locked_within_its_range() -> None:
    """A dependency added to pyproject.toml without `make lock` would install unpinned."""
    pins = locked()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in the lock: run make lock"
        version = pinned_version(pins[name])
        assert req.specifier.contains(version, prereleases=True), (
            f"{req.name}=={version} in the lock is outside pyproject.toml's {req.specifier}:"
            " run make lock"
        )


def test_the_installers_are_locked_too() -> None:
    """pip, and setuptools and wheel for building the project itself."""
    build = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]
    pins = locked()
    assert "pip" in pins
    for req in map(Requirement, build["requires"]):
        name = canonicalize_name(req.name)
        assert name in pins, f"build requirement {req.name} is not locked"
        assert req.specifier.contains(pinned_version(pins[name]))


def test_this_environment_has_exactly_the_locked_versions() -> None:
    """The suite runs in what `make venv` installed: the lock's versions, nothing newer."""
    wrong = {}
    for name, req in locked().items():
        if req.marker is not None and not req.marker.evaluate():
            continue  # another platform's package (colorama on Windows)
        want = pinned_version(req)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have != want:
            wrong[name] = f"{have} (lock: {want})"
    assert not wrong, (
        f"installed versions differ from requirements.lock: {wrong};"
        " reinstall with: rm .venv/.installed && make venv"
    )


def recipe(target: str) -> str:
    """The recipe lines of one Makefile target, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", MAKEFILE.read_text(encoding="utf-8"))
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.MULTILINE)
    assert match, f"no {target} rule in the Makefile"
    return match[1]


def test_make_venv_installs_every_package_from_the_lock() -> None:
    make = MAKEFILE.read_text(encoding="utf-8")
    assert re.search(r"^LOCK := requirements\.lock$", make, re.MULTILINE)
    assert re.search(r"^\$\(STAMP\):.*\$\(LOCK\)", make, re.MULTILINE), (
        "the venv must be reinstalled when the lock changes"
    )
    installs = [line for line in recipe("$(STAMP)").splitlines() if "pip install" in line]
    assert any("-e '.[dev]'" in line for line in installs)
    for line in installs:
        assert "-c $(LOCK)" in line, f"installs without the lock: {line.strip()}"
        if "-e " in line:
            assert "--build-constraint $(LOCK)" in line, "the build backend is unpinned"


def test_make_lock_regenerates_the_lock_with_a_pinned_tool() -> None:
    lines = recipe("lock")
    assert "uv pip compile pyproject.toml" in lines
    assert "--extra dev" in lines
    assert "-o $(LOCK)" in lines
    assert re.search(r"^UV := uv==\d+\.\d+\.\d+$", MAKEFILE.read_text(), re.MULTILINE)
    assert LOCK.read_text(encoding="utf-8").splitlines()[1].strip() == "#    make lock"


def test_ci_installs_through_make() -> None:
    """.ci/run installs nothing itself: `make test` builds the venv from the lock."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "make test" in ci
    assert "pip install" not in ci
