"""The chart's alerts (a PrometheusRule) and Grafana dashboard (a ConfigMap), rendered by the
real Helm engine: every PromQL expression parses (promql-parser, the Rust parser Prometheus'
grammar is ported to), names only series and labels kubegpu's own /metrics exports, and
every label an annotation or a legend shows is one its query's result carries.

The PrometheusRule has no schema in the Kubernetes API: its shape is checked against the
fields of the Prometheus Operator's CRD (monitoring.coreos.com_prometheusrules.yaml of
prometheus-operator/prometheus-operator, operator 0.82: `spec.groups[]` with a required
`name`, `interval`, `labels`, `limit`, `partial_response_strategy`, `query_offset` and
`rules[]`; each rule `alert` or `record`, a required `expr`, `for` and `keep_firing_for`
as Prometheus durations, `labels` and `annotations` as maps of strings). Unknown fields are
refused here, where the API server would prune them without a word.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import promql_parser as promql
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubegpu.metrics import DeviceHealthRow, Metrics, UsageRow, UsageSnapshot

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "kubegpu"
DASHBOARD = CHART / "dashboards" / "kubegpu.json"
OBSERVABILITY = REPO / "docs" / "observability.md"

#: Labels a series gets from its scrape, not from kubegpu: `node` from the chart's
#: ServiceMonitor, the others from the Prometheus Operator's target labels.
TARGET_LABELS = frozenset({"node", "namespace", "pod", "container", "instance", "job"})
TARGET_LABELS |= {"service", "endpoint"}

#: The Prometheus Operator's duration pattern (its CRDs' `for`, `interval`).
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$"
)
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": {"type": "string", "pattern": DURATION},
        "keep_firing_for": {"type": "string", "minLength": 1, "pattern": DURATION},
        "labels": STRINGS,
        "annotations": STRINGS,
    },
}
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": DURATION},
                            "labels": STRINGS,
                            "limit": {"type": "integer"},
                            "partial_response_strategy": {"type": "string"},
                            "query_offset": {"type": "string", "pattern": DURATION},
                            "rules": {"type": "array", "items": RULE},
                        },
                    },
                }
            },
        },
    },
}

Doc = dict[str, Any]


def render(chart: Any, vals: dict[str, Any]) -> list[Doc]:
    chart.validate_schema(vals)
    out = chart.render(vals, name="kubegpu", namespace="kube-system", is_install=True)
    return [d for name, text in sorted(out.items()) if name.endswith(".yaml") for d in _load(text)]


def _load(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


ALL_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    }
}


# --- what kubegpu exports ------------------------------------------------------------------


def _exported() -> dict[str, frozenset[str]]:
    """Series name -> its label names, from a scrape of `Metrics` with every family in use."""
    m = Metrics()
    resource = "nvidia.com/gpu"
    m.set_devices(resource, 8, 7)
    m.observe_allocate(resource, 0.0004)
    m.observe_allocate(resource, 0.0004, "INVALID_ARGUMENT")
    m.xid("GPU-a", 79)
    m.registration(resource, ok=True)
    m.kubelet_restart()
    m.config_reload(ok=True)
    m.health_transition(resource, healthy=False)
    m.event_dropped("queue-full")
    m.set_stale_resources([resource])
    device = ("0", "GPU-a", "0000:17:00.0", "nvidia0", "H100", "node-a", "1g.10gb", "9")
    row = UsageRow(*device, "ml", "train-0", "main", "claim-0", 1, 2, 3, 1)
    m.follow_usage(lambda: UsageSnapshot(rows=(row,), sources={"processes": True}))
    m.follow_devices(lambda: [DeviceHealthRow(*device, healthy=False)])
    families = list(m.registry.collect())
    # Every family has a sample here, so a family added later is in use here too.
    assert all(f.samples for f in families), [f.name for f in families if not f.samples]
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in found.items()}


EXPORTED = _exported()


def test_the_exported_series_are_the_ones_scraped() -> None:
    assert "kubegpu_allocate_errors_total" in EXPORTED
    assert "kubegpu_allocate_duration_seconds_bucket" in EXPORTED
    assert {"le", "resource"} <= EXPORTED["kubegpu_allocate_duration_seconds_bucket"]
    assert {"Hostname", "UUID", "GPU_I_ID"} <= EXPORTED["kubegpu_gpu_healthy"]
    assert "pod" in EXPORTED["kubegpu_container_gpu_memory_limit_bytes"]


# --- PromQL ---------------------------------------------------------------------------------

_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$node": ".*",
    "$namespace": ".*",
}


def parse(expr: str) -> promql.Expr:
    """`expr`, with Grafana's variables replaced by values of their kind."""
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a variable the dashboard does not define: {expr}"
    return promql.parse(expr)


def selectors(tree: promql.Expr) -> list[promql.VectorSelector]:
    found: list[promql.VectorSelector] = []

    def visit(node: promql.Expr) -> None:
        if isinstance(node, promql.VectorSelector):
            found.append(node)

    promql.walk(tree, visit)
    return found


def grouping_labels(tree: promql.Expr) -> set[str]:
    """Labels named in `by`, `without`, `on`, `ignoring` and `group_left/right`."""
    found: set[str] = set()

    def visit(node: promql.Expr) -> None:
        if isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            found.update(node.modifier.labels)
        if isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                found.update(node.modifier.matching.labels)
            found.update(node.modifier.group_labels or ())

    promql.walk(tree, visit)
    return found


def series_labels(name: str | None) -> frozenset[str]:
    assert name in EXPORTED, f"{name} is not a series kubegpu exports"
    return EXPORTED[name] | TARGET_LABELS


def result_labels(node: Any) -> frozenset[str]:
    """The labels the result of `node` can carry (what an alert or a legend may show)."""
    if isinstance(node, promql.VectorSelector):
        return series_labels(node.name)
    if isinstance(node, promql.MatrixSelector):
        return result_labels(node.vector_selector)
    if isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
        return result_labels(node.expr)
    if isinstance(node, promql.AggregateExpr):
        if node.modifier is None:
            return frozenset()
        if node.modifier.type == promql.AggModifierType.By:
            return frozenset(node.modifier.labels)
        return result_labels(node.expr) - set(node.modifier.labels)
    if isinstance(node, promql.Call):
        inner = frozenset().union(*(result_labels(a) for a in node.args))
        return inner - {"le"} if node.func.name == "histogram_quantile" else inner
    if isinstance(node, promql.BinaryExpr):
        left, right = result_labels(node.lhs), result_labels(node.rhs)
        if str(node.op) == "or" or isinstance(node.lhs, promql.NumberLiteral):
            return left | right
        return left
    return frozenset()


def check(expr: str) -> promql.Expr:
    """Parse `expr` and check every series and label it names is one kubegpu exports."""
    tree = parse(expr)
    found = selectors(tree)
    assert found, f"no series in {expr}"
    known: set[str] = set(TARGET_LABELS)
    for selector in found:
        known |= series_labels(selector.name)
    for selector in found:
        for matcher in selector.matchers.matchers:
            assert matcher.name in known, f"{expr}: no series has the label {matcher.name}"
    unknown = grouping_labels(tree) - known
    assert not unknown, f"{expr}: no series has the labels {sorted(unknown)}"
    return tree


def test_the_check_refuses_what_kubegpu_does_not_export() -> None:
    check("kubegpu_allocate_errors_total")
    for bad in (
        "kubegpu_allocate_errors",  # a counter without _total matches nothing
        'kubegpu_devices{uuid="x"}',
        "sum by (UUID) (kubegpu_devices)",
        "kubegpu_gpu_healthy unless on (gpu_uuid) kubegpu_gpu_healthy",
        "sum(rate(kubegpu_allocations_total[5m])",
    ):
        with pytest.raises((AssertionError, ValueError)):
            check(bad)
    assert "pod" not in result_labels(parse("min by (UUID) (kubegpu_gpu_healthy)"))


# --- the PrometheusRule ---------------------------------------------------------------------


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of `markdown`."""
    anchors = set()
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    for heading in re.findall(r"^#+ (.+)$", prose, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def prometheus_rule(chart: Any, vals: dict[str, Any]) -> Doc:
    found = of_kind(render(chart, vals), "PrometheusRule")
    assert len(found) == 1
    return found[0]


def alerts(rule: Doc) -> dict[str, Doc]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_the_alerts_are_shaped_as_the_operator_reads_them_and_name_only_kubegpus_series(
    chart: Any,
) -> None:
    rule = prometheus_rule(chart, ALL_ON)
    jsonschema.validate(rule, PROMETHEUS_RULE)
    anchors = github_anchors(OBSERVABILITY.read_text(encoding="utf-8"))
    found = alerts(rule)
    assert set(found) == {
        "KubegpuContainerNearGPUMemoryLimit",
        "KubegpuGPUUnhealthy",
        "KubegpuGPULost",
        "KubegpuStaleDevicePluginResource",
    }
    for name, alert in found.items():
        tree = check(alert["expr"])
        carried = result_labels(tree)
        notes = alert["annotations"]
        assert notes["summary"] and notes["description"], name
        for text in (notes["summary"], notes["description"]):
            shown = set(re.findall(r"\$labels\.(\w+)", text))
            assert shown <= carried, f"{name} shows {sorted(shown - carried)}, not on its result"
        url = notes["runbook_url"]
        assert url.startswith("https://github.com/kubegpu/kubegpu/blob/main/docs/observability.md#")
        assert url.rsplit("#", 1)[1] == name.lower() and name.lower() in anchors, name
        assert alert["labels"]["severity"] in {"warning", "critical"}
        assert alert["for"] == "5m"


def test_the_near_limit_alert_is_per_container_and_gpu(chart: Any) -> None:
    alert = alerts(prometheus_rule(chart, ALL_ON))["KubegpuContainerNearGPUMemoryLimit"]
    carried = result_labels(parse(alert["expr"]))
    assert {"namespace", "pod", "container", "gpu", "UUID", "GPU_I_ID", "Hostname"} <= carried
    assert alert["expr"].rstrip().endswith("> 0.95")


def test_the_gpu_alerts_are_one_per_gpu_and_the_lost_one_matches_by_uuid(chart: Any) -> None:
    found = alerts(prometheus_rule(chart, ALL_ON))
    unhealthy = parse(found["KubegpuGPUUnhealthy"]["expr"])
    assert result_labels(unhealthy) == {"node", "Hostname", "gpu", "UUID", "modelName"}
    lost = parse(found["KubegpuGPULost"]["expr"])
    # (what the node had in the window, unless it has it now) and kubegpu runs there.
    assert isinstance(lost, promql.BinaryExpr) and str(lost.op) == "and"
    assert lost.modifier is not None and lost.modifier.matching is not None
    assert lost.modifier.matching.labels == ["node"]
    assert [s.name for s in selectors(lost.rhs)] == ["kubegpu_build_info"]
    had = lost.lhs.expr if isinstance(lost.lhs, promql.ParenExpr) else lost.lhs
    assert isinstance(had, promql.BinaryExpr) and str(had.op) == "unless"
    assert had.modifier is not None and had.modifier.matching is not None
    assert set(had.modifier.matching.labels) == {"Hostname", "UUID"}
    window = [n for n in _nodes(had.lhs) if isinstance(n, promql.MatrixSelector)]
    assert [w.range.total_seconds() for w in window] == [3600]


def _nodes(tree: promql.Expr) -> list[Any]:
    found: list[Any] = []
    promql.walk(tree, found.append)
    return found


def test_thresholds_durations_severities_and_labels_come_from_the_values(chart: Any) -> None:
    vals: dict[str, Any] = {
        "metrics": {
            "prometheusRule": {
                "enabled": True,
                "additionalLabels": {"release": "prometheus"},
                "runbookUrl": "https://docs.example.com/kubegpu/alerts/",
                "nearMemoryLimit": {"threshold": 0.9, "for": "10m", "severity": "page"},
                "gpuUnhealthy": {"for": "1m"},
                "gpuLost": {"window": "6h", "for": "0"},
                "staleResource": {"for": "1h30m", "severity": "info"},
            }
        }
    }
    rule = prometheus_rule(chart, vals)
    jsonschema.validate(rule, PROMETHEUS_RULE)
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    found = alerts(rule)
    near = found["KubegpuContainerNearGPUMemoryLimit"]
    assert near["expr"].rstrip().endswith("> 0.9")
    assert (near["for"], near["labels"]["severity"]) == ("10m", "page")
    assert found["KubegpuGPUUnhealthy"]["for"] == "1m"
    assert "for 1m" in found["KubegpuGPUUnhealthy"]["annotations"]["description"]
    lost = found["KubegpuGPULost"]
    assert "[6h]" in lost["expr"] and lost["for"] == "0"
    assert "in the last 6h" in lost["annotations"]["description"]
    stale = found["KubegpuStaleDevicePluginResource"]
    assert (stale["for"], stale["labels"]["severity"]) == ("1h30m", "info")
    url = found["KubegpuGPULost"]["annotations"]["runbook_url"]
    assert url == "https://docs.example.com/kubegpu/alerts#kubegpugpulost"
    for alert in found.values():
        check(alert["expr"])


@pytest.mark.parametrize(
    "bad",
    [
        {"nearMemoryLimit": {"threshold": 1.5}},
        {"nearMemoryLimit": {"threshold": 0}},
        {"nearMemoryLimit": {"threshold": "0.95"}},
        {"gpuUnhealthy": {"for": "5 minutes"}},
        {"gpuLost": {"window": "0"}},
        {"gpuLost": {"window": "0h0m"}},
        {"gpuLost": {"window": "1h5"}},
        {"staleResource": {"severity": ""}},
        {"runbookUrl": "docs/observability.md"},
        {"nearMemoryLimit": {"treshold": 0.9}},
    ],
)
def test_the_schema_and_the_chart_refuse_bad_alert_values(chart: Any, bad: dict[str, Any]) -> None:
    vals = {"metrics": {"prometheusRule": {"enabled": True, **bad}}}
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)):
        render(chart, vals)


def test_the_rule_exists_only_when_enabled_with_metrics_and_the_plugin(chart: Any) -> None:
    assert not of_kind(render(chart, {}), "PrometheusRule")
    on = {"metrics": {"prometheusRule": {"enabled": True}}}
    assert len(of_kind(render(chart, on), "PrometheusRule")) == 1
    off = {"metrics": {"enabled": False, "prometheusRule": {"enabled": True}}}
    assert not of_kind(render(chart, off), "PrometheusRule")
    labeller_only = {**on, "devicePlugin": {"enabled": False}, "gfd": {"enabled": True}}
    assert not of_kind(render(chart, labeller_only), "PrometheusRule")


def test_the_service_monitor_keeps_the_pods_labels_and_adds_the_node(chart: Any) -> None:
    (monitor,) = of_kind(render(chart, ALL_ON), "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    # Else the pod using the GPU becomes `exported_pod`, and `pod` the plugin's own.
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_node_name"],
            "targetLabel": "node",
            "action": "replace",
        }
    ]
    vals = {"metrics": {"serviceMonitor": {"enabled": True, "honorLabels": False}}}
    (monitor,) = of_kind(render(chart, vals), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is False


# --- the dashboard --------------------------------------------------------------------------

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> Doc:
    loaded: Doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def panels(board: Doc) -> list[Doc]:
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def test_the_dashboard_has_its_variables_and_every_panel_reads_the_chosen_datasource() -> None:
    board = dashboard()
    assert board["uid"] == "kubegpu" and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "node", "namespace"}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    for name in ("node", "namespace"):
        variable = variables[name]
        assert variable["datasource"] == DATASOURCE
        # "All" matches a series without the label too (a scrape without the node label).
        assert variable["includeAll"] and variable["allValue"] == ".*"
        query = variable["query"]["query"]
        assert query == variable["definition"]
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert match, query
        check(match[1])
        assert match[2] == name
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_every_dashboard_query_names_only_kubegpus_series_and_labels() -> None:
    queries = 0
    for panel in panels(dashboard()):
        for target in panel.get("targets", []):
            tree = check(target["expr"])
            queries += 1
            shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            carried = result_labels(tree)
            assert shown <= carried, f"{panel['title']}: legend shows {sorted(shown - carried)}"
    assert queries >= 10


def test_the_dashboard_shows_what_the_alerts_watch() -> None:
    named = {
        s.name
        for p in panels(dashboard())
        for t in p.get("targets", [])
        for s in selectors(parse(t["expr"]))
    }
    assert {
        "kubegpu_container_gpu_memory_used_bytes",
        "kubegpu_container_gpu_memory_limit_bytes",
        "kubegpu_container_gpu_sm_utilization_percent",
        "kubegpu_gpu_healthy",
        "kubegpu_allocations_total",
        "kubegpu_allocate_duration_seconds_bucket",
        "kubegpu_stale_node_resources",
    } <= named


def test_the_dashboard_configmap_is_rendered_only_when_enabled_and_is_valid(chart: Any) -> None:
    assert not [
        d for d in of_kind(render(chart, {}), "ConfigMap") if "dashboard" in d["metadata"]["name"]
    ]
    vals = {
        "metrics": {
            "grafanaDashboard": {
                "enabled": True,
                "namespace": "monitoring",
                "additionalLabels": {"team": "gpu"},
                "annotations": {"grafana_folder": "GPUs"},
            }
        }
    }
    (cm,) = [
        d
        for d in of_kind(render(chart, vals), "ConfigMap")
        if d["metadata"]["name"] == "kubegpu-dashboard"
    ]
    kubernetes_validate.validate(cm, "1.36.0", strict=True)
    kubernetes_validate.validate(cm, "1.33.0", strict=True)
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["team"] == "gpu"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    assert json.loads(cm["data"]["kubegpu.json"]) == dashboard()
    sidecar = {"enabled": True, "label": "dashboards", "labelValue": "kubegpu"}
    (cm,) = [
        d
        for d in of_kind(render(chart, {"metrics": {"grafanaDashboard": sidecar}}), "ConfigMap")
        if d["metadata"]["name"] == "kubegpu-dashboard"
    ]
    assert cm["metadata"]["namespace"] == "kube-system"
    assert cm["metadata"]["labels"]["dashboards"] == "kubegpu"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    off = {"metrics": {"enabled": False, "grafanaDashboard": {"enabled": True}}}
    assert not [
        d
        for d in of_kind(render(chart, off), "ConfigMap")
        if d["metadata"]["name"] == "kubegpu-dashboard"
    ]
