"""Facts the docs state that the code decides: metric names, the config poll interval,
and the newcomer's map (docs/architecture.md): its layer table against the import-linter
layers contract, its root-task table against `Daemon.run`, its error tree against the
exception classes, and the paths it names.

Every metric name the docs and chart tell an operator to query is one kubegpu exposes.

A PromQL example with `kubegpu_allocate_errors` instead of `kubegpu_allocate_errors_total`
silently matches nothing, so an alert written from the docs would never fire.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import click
import pytest

from kubegpu.cli.serve import serve
from kubegpu.metrics import Metrics, UsageSnapshot

REPO = Path(__file__).resolve().parents[3]
CHART_TEMPLATES = REPO / "deployments" / "helm" / "kubegpu" / "templates"
DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *CHART_TEMPLATES.iterdir()])
NAME = re.compile(r"\bkubegpu_[a-z_]+[a-z]\b")


def exposed_names() -> set[str]:
    """Series names a scrape can return (counters as `_total`, histograms as `_bucket`...).

    Read from the registry's families, not a scrape: a labelled family shows no series
    until its first label set is used.
    """
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    metrics = Metrics()
    # The per-container GPU families, as the daemon collects them at every scrape.
    metrics.follow_usage(UsageSnapshot)
    metrics.follow_devices(tuple)
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_documented_metric_names_are_exposed(document: Path) -> None:
    exposed = exposed_names()
    # A histogram's family name (without `_bucket`/`_sum`/`_count`) names it in prose.
    families = {n.removesuffix("_bucket") for n in exposed if n.endswith("_bucket")}
    mentioned = set(NAME.findall(document.read_text(encoding="utf-8")))
    unknown = sorted(mentioned - exposed - families)
    assert not unknown, f"{document.name} names metrics that are not exposed: {unknown}"


def test_the_check_sees_counters_only_with_their_total_suffix() -> None:
    exposed = exposed_names()
    assert "kubegpu_allocate_errors_total" in exposed
    assert "kubegpu_allocate_errors" not in exposed


POLL_DOCS = ["configuration.md", "sharing.md", "architecture.md"]


@pytest.mark.parametrize("name", POLL_DOCS)
def test_docs_state_the_config_poll_interval_the_code_uses(name: str) -> None:
    from kubegpu.config.source import POLL_INTERVAL

    text = (REPO / "docs" / name).read_text(encoding="utf-8")
    stated = {float(n) for n in re.findall(r"poll\w*[^.]{0,40}?\(?(?:every )?(\d+\.\d+) s", text)}
    assert stated == {POLL_INTERVAL}, f"{name} gives the config poll as {stated}"


# -- docs/architecture.md, the newcomer's map: the tables the code decides -----------------

ARCHITECTURE = REPO / "docs" / "architecture.md"
SRC = REPO / "src" / "kubegpu"


def _section(heading: str) -> str:
    """The text of one `## heading` section of architecture.md."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _contract_layers() -> dict[str, int]:
    """Module -> layer number (1 = top) of pyproject's layers contract."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return {
        module.strip().removeprefix("kubegpu."): number
        for number, line in enumerate(contract["layers"], start=1)
        for module in line.split("|")
    }


def _table_layers() -> dict[str, int]:
    """Module -> layer number as the layer table of architecture.md gives them."""
    rows = re.findall(r"^\| (\d+) \| `([a-z_]+)`", _section("Modules and layers"), re.M)
    table: dict[str, int] = {}
    for number, module in rows:
        assert module not in table, f"architecture.md lists {module} twice in the layer table"
        table[module] = int(number)
    return table


def test_the_layer_table_is_the_import_linter_layers_contract() -> None:
    contract, table = _contract_layers(), _table_layers()
    assert len(contract) > 10, "the layers contract was not read"
    missing = sorted(set(contract) - set(table))
    extra = sorted(set(table) - set(contract))
    assert not missing, f"architecture.md's layer table lacks {missing}: add a row each"
    assert not extra, f"architecture.md's layer table has {extra}, not in the contract"
    wrong = {m: (table[m], n) for m, n in contract.items() if table[m] != n}
    assert not wrong, f"layer numbers (table, pyproject) disagree: {wrong}"


def test_the_layer_check_notices_a_module_in_the_wrong_layer() -> None:
    table = _table_layers()
    table["state"] += 1
    assert table != _contract_layers()


def _front_root_tasks(module: str) -> list[str]:
    """Names of the `("name", coroutine)` pairs a front's `root_tasks` returns, in order."""
    tree = ast.parse((SRC / module).read_text(encoding="utf-8"))
    (method,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "root_tasks"
    ]
    pairs = [
        (n.lineno, n.elts[0].value)
        for n in ast.walk(method)
        if isinstance(n, ast.Tuple)
        and len(n.elts) == 2
        and isinstance(n.elts[0], ast.Constant)
        and isinstance(n.elts[0].value, str)
    ]
    return [name for _, name in sorted(pairs)]


def _root_tasks_started_by_the_daemon() -> list[str]:
    """The front's root tasks first (DRA's, then the device plugin's: the daemon starts
    one front's), then the names of `tasks.start("name", ..., root=True)` in daemon.py,
    in start order."""
    fronts = _front_root_tasks("dra/front.py") + _front_root_tasks("plugin/front.py")
    tree = ast.parse((SRC / "daemon.py").read_text(encoding="utf-8"))
    names = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "start"
            and any(
                k.arg == "root" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
        ):
            first = node.args[0]
            if isinstance(first, ast.Name):
                continue  # the front's, named in its `root_tasks` (read above)
            assert isinstance(first, ast.Constant) and isinstance(first.value, str)
            names.append((node.lineno, first.value))
    return fronts + [name for _, name in sorted(names)]


def test_the_root_task_table_names_the_daemons_root_tasks_in_start_order() -> None:
    started = _root_tasks_started_by_the_daemon()
    assert "plugins" in started, "the scan of the fronts found no root tasks"
    assert "mps" in started, "the scan of daemon.py found no root tasks"
    documented = re.findall(r"^\s*\| `([a-z ]+)` \|", _section("The daemon's root tasks"), re.M)
    assert documented == started, (
        f"architecture.md's root-task table {documented} is not what Daemon.run starts {started}"
    )


def _kubegpu_error_classes() -> set[str]:
    """Every exception class in src/ that derives (by name) from `KubegpuError`."""
    bases: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {b.id for b in node.bases if isinstance(b, ast.Name)}
                bases.setdefault(node.name, set()).update(names)
    found = {"KubegpuError"}
    while True:
        more = {c for c, b in bases.items() if b & found} - found
        if not more:
            return found
        found |= more


def test_every_kubegpu_error_is_in_both_drawings_of_the_error_tree() -> None:
    classes = _kubegpu_error_classes()
    assert {"ConfigError", "KubeError", "MpsError", "AdmissionError"} <= classes
    import kubegpu.errors

    for name, text in (
        ("errors.py's docstring", kubegpu.errors.__doc__ or ""),
        ("architecture.md's Errors", _section("Errors")),
    ):
        drawn = set(re.findall(r"\b([A-Z][A-Za-z]*Error)\b", text))
        missing = sorted(classes - drawn)
        assert not missing, f"{name} does not draw {missing}"


#: Paths a newcomer follows from the map and the README; each must exist.
PATH = re.compile(r"`((?:src|tests|docs|deployments|benchmarks|\.ci)/[\w./-]*\w/?)`")


@pytest.mark.parametrize("document", [ARCHITECTURE, REPO / "README.md"], ids=lambda p: p.name)
def test_paths_named_in_the_map_exist(document: Path) -> None:
    named = set(PATH.findall(document.read_text(encoding="utf-8")))
    assert named, f"no paths found in {document.name}: the pattern is broken"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{document.name} names paths that do not exist: {missing}"


def test_every_serve_option_and_its_env_vars_are_in_configuration_md() -> None:
    """README promises "every config key, flag and env var" in docs/configuration.md."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    options = [p for p in serve.params if isinstance(p, click.Option) and p.envvar]
    assert len(options) > 30, "serve's options were not read"
    missing: list[str] = []
    for option in options:
        envvar = option.envvar or ()
        envvars = [envvar] if isinstance(envvar, str) else list(envvar)
        names = [option.opts[0], *envvars]
        missing += [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/configuration.md does not mention serve's {missing}"


def _class_members() -> dict[str, set[str]]:
    """Class name -> its methods and attributes (`self.x = ...` included), over src/."""
    members: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            found = members.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    found.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.add(item.target.id)
            # Instance attributes: `self.x = ...` in any method.
            found.update(
                item.attr
                for item in ast.walk(node)
                if isinstance(item, ast.Attribute)
                and isinstance(item.ctx, ast.Store)
                and isinstance(item.value, ast.Name)
                and item.value.id == "self"
            )
    return members


def test_the_classes_and_members_the_map_names_exist() -> None:
    """A stale `Daemon._refresh` in the map would send a newcomer nowhere."""
    members = _class_members()
    named = set(re.findall(r"`([A-Z]\w+)\.(\w+)`", ARCHITECTURE.read_text(encoding="utf-8")))
    assert ("Inventory", "with_health") in named, "the pattern no longer finds Class.member"
    missing = sorted(f"{c}.{m}" for c, m in named if m not in members.get(c, set()))
    assert not missing, f"architecture.md names members that do not exist: {missing}"
    assert "_refresh" not in members["Daemon"], "the check would not see a stale Daemon._refresh"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a name under a module, not a package
        return False


def test_the_kubegpu_names_the_map_gives_import() -> None:
    named = set(re.findall(r"`(kubegpu(?:\.\w+)+)`", ARCHITECTURE.read_text(encoding="utf-8")))
    assert named, "the pattern no longer finds kubegpu.* names"
    missing = []
    for name in sorted(named):
        parts = name.split(".")
        # The longest importable prefix, then attributes (`kubegpu.kube.KubeClient`).
        cut = next(i for i in range(len(parts), 0, -1) if _importable(".".join(parts[:i])))
        obj: object = importlib.import_module(".".join(parts[:cut]))
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute, None)
        if obj is None:
            missing.append(name)
    assert not missing, f"architecture.md names {missing}, which do not exist"
