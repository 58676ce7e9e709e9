"""Only `kubegpu.devices` reads sysfs, checked on the source.

import-linter cannot see a file read, so this scans the AST: a string naming a sysfs
path (`/sys/...`, `sys/bus/...`, `sys/class/...`, or a bare `sys` joined onto a root)
that reaches a filesystem call (`open`, `Path(...)`, `os.listdir`, `.read_text`,
`.iterdir`, `os.path.join`...) or a `/` path join, directly or through a name bound to
it. Prose (docstrings, `--help` text) and config defaults are not reads and pass.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "kubegpu"
DEVICES = SRC / "devices"

# `/sys/...`, `sys/<dir>` at the start of a relative path, or `sys` alone (a join part).
_SYSFS = re.compile(r"(?:^|/)sys/|^/?sys/?$")
# Calls that open, list, test or build a filesystem path from their arguments.
_FS_FUNCTIONS = {"open", "Path", "PurePath", "PosixPath", "listdir", "scandir", "walk", "glob"}
_FS_METHODS = _FS_FUNCTIONS | {
    "iglob",
    "rglob",
    "read_text",
    "read_bytes",
    "iterdir",
    "joinpath",
    "join",
    "exists",
    "isdir",
    "isfile",
    "is_dir",
    "is_file",
    "stat",
    "lstat",
    "readlink",
    "realpath",
}


def _sysfs_strings(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        text = sub.value if isinstance(sub, ast.Constant) else None
        if isinstance(text, str) and _SYSFS.search(text):
            yield text


def _names_bound_to_sysfs(tree: ast.AST) -> set[str]:
    """Names assigned a sysfs path (`KFD_TOPOLOGY = "sys/class/kfd/..."`), any scope."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(_sysfs_strings(node.value)):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.AnnAssign)
            and node.value is not None
            and isinstance(node.target, ast.Name)
            and any(_sysfs_strings(node.value))
        ):
            names.add(node.target.id)
    return names


def _names_sysfs(node: ast.AST, bound: set[str]) -> bool:
    if any(_sysfs_strings(node)):
        return True
    return any(isinstance(sub, ast.Name) and sub.id in bound for sub in ast.walk(node))


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id if call.func.id in _FS_FUNCTIONS else None
    if isinstance(call.func, ast.Attribute):
        return call.func.attr if call.func.attr in _FS_METHODS else None
    return None


def sysfs_reads(source: str) -> list[int]:
    """Line numbers where `source` reads (or builds a path to read) under /sys."""
    tree = ast.parse(source)
    bound = _names_bound_to_sysfs(tree)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node) is not None:
            arguments = [*node.args, *(k.value for k in node.keywords)]
            if any(_names_sysfs(arg, bound) for arg in arguments):
                lines.add(node.lineno)
        # `root / "sys/class/drm"`: `/` with a string operand is always a path join.
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and (_names_sysfs(node.left, bound) or _names_sysfs(node.right, bound))
        ):
            lines.add(node.lineno)
    return sorted(lines)


def _modules(under: Path) -> list[Path]:
    return sorted(under.rglob("*.py"))


def readers_outside_devices(package: Path) -> dict[str, list[int]]:
    """Module (relative to `package`) -> lines reading sysfs, for modules not in devices/."""
    devices = package / "devices"
    return {
        str(path.relative_to(package)): lines
        for path in _modules(package)
        if devices not in path.parents and (lines := sysfs_reads(path.read_text(encoding="utf-8")))
    }


def test_only_devices_reads_sysfs() -> None:
    found = readers_outside_devices(SRC)
    assert not found, (
        f"sysfs read outside kubegpu.devices at {found}: move the reader into "
        "kubegpu/devices/ (with a root= argument) and pass its result in"
    )


def test_the_scan_sees_the_readers_devices_has() -> None:
    """The real idioms in devices/ are found, so a copy of them elsewhere would be."""
    hits = {
        str(path.relative_to(DEVICES))
        for path in _modules(DEVICES)
        if sysfs_reads(path.read_text(encoding="utf-8"))
    }
    assert {"pci.py", "amd.py", "nvml/discovery.py"} <= hits


PLANTED = {
    "open": 'def f() -> str:\n    return open("/sys/class/dmi/id/product_name").read()\n',
    "Path.read_text": (
        'from pathlib import Path\nNAME = Path("/sys/class/dmi/id/product_name").read_text()\n'
    ),
    "Path with a root": (
        "from pathlib import Path\n"
        "def f(root: str) -> list[Path]:\n"
        '    return list(Path(root, "sys/bus/pci/devices").iterdir())\n'
    ),
    "os.listdir": 'import os\nNAMES = os.listdir("/sys/class/drm")\n',
    "os.path.join": (
        'import os\ndef f(root: str) -> str:\n    return os.path.join(root, "sys", "bus")\n'
    ),
    "a / join": (
        "from pathlib import Path\n"
        "def f(root: Path) -> bytes:\n"
        '    return (root / "sys/bus/pci/devices" / "0000:17:00.0" / "config").read_bytes()\n'
    ),
    "a constant": (
        "from pathlib import Path\n"
        'KFD = "sys/class/kfd/kfd/topology/nodes"\n'
        "def f(root: Path) -> list[Path]:\n"
        "    return sorted((root / KFD).iterdir())\n"
    ),
    "an f-string": (
        "def f(root: str, card: str) -> str:\n"
        '    with open(f"{root}/sys/kernel/debug/dri/{card}/name") as file:\n'
        "        return file.read()\n"
    ),
}


@pytest.mark.parametrize("source", PLANTED.values(), ids=PLANTED.keys())
def test_the_scan_catches_a_planted_read(source: str) -> None:
    assert sysfs_reads(source)


def test_a_planted_read_outside_devices_fails_the_check(tmp_path: Path) -> None:
    """The whole check over a small tree: devices/ may read, labels.py may not."""
    package = tmp_path / "kubegpu"
    (package / "devices").mkdir(parents=True)
    pci = (SRC / "devices" / "pci.py").read_text(encoding="utf-8")
    (package / "devices" / "pci.py").write_text(pci, encoding="utf-8")
    labels = (SRC / "labels.py").read_text(encoding="utf-8")
    (package / "labels.py").write_text(labels, encoding="utf-8")
    assert readers_outside_devices(package) == {}
    planted = labels + textwrap.dedent(
        """
        def machine() -> str:
            return open("/sys/class/dmi/id/product_name").read()
        """
    )
    (package / "labels.py").write_text(planted, encoding="utf-8")
    assert readers_outside_devices(package) == {"labels.py": [len(labels.splitlines()) + 3]}


NOT_READS = {
    "a docstring": '"""Reads `<root>/sys/bus/pci/devices` (see devices.pci)."""\n',
    "help text": (
        "import click\n"
        'OPTION = click.option("--sysfs-root", help="root under which sys/bus/pci is read",\n'
        '    show_default="/sys/class/dmi/id/product_name")\n'
    ),
    "a config default": (
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Gfd:\n"
        '    machine_type_file: str = "/sys/class/dmi/id/product_name"\n'
    ),
    "the sys module": 'import sys\nARGS = open(sys.argv[1]).read()\nNAME = "system"\n',
}


@pytest.mark.parametrize("source", NOT_READS.values(), ids=NOT_READS.keys())
def test_prose_and_defaults_are_not_reads(source: str) -> None:
    assert sysfs_reads(source) == []
