"""The Helm chart, rendered by the real Helm engine and validated against Kubernetes schemas."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "kubegpu"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
#: The oldest release the device-plugin mode's objects are checked against.
KUBE_VERSION = "1.33.0"
#: Every object is checked against 1.36 too: resource.k8s.io/v1 (DRA) is GA in 1.34, and
#: DeviceClass.extendedResourceName beta in 1.36, the first release the chart's DRA mode is
#: made for. (kubernetes-validate 1.37.0 ships schemas up to 1.37.0.)
DRA_KUBE_VERSION = "1.36.0"
#: The variables of `kubegpu serve`'s DRA flags (NVIDIA's DRA driver's names for the last two).
DRA_FLAGS = {"KUBEGPU_MODE", "KUBELET_REGISTRAR_DIRECTORY_PATH", "KUBELET_PLUGINS_DIRECTORY_PATH"}
HUP_IGNORED = ("env", "--ignore-signal=HUP")  # the image entrypoint and the chart start so
#: Custom resources: not in the core schemas, checked for shape instead.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "NodeFeature"}

Doc = dict[str, Any]


def values(scenario: str) -> dict[str, Any]:
    loaded = yaml.safe_load((CHART / "ci" / scenario).read_text())
    return loaded or {}


def render(chart: Any, vals: dict[str, Any] | None = None) -> list[Doc]:
    out = chart.render(vals or {}, name="kubegpu", namespace="kube-system", is_install=True)
    docs: list[Doc] = []
    for template, text in sorted(out.items()):
        if template.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def container(ds: Doc) -> Doc:
    spec = ds["spec"]["template"]["spec"]
    assert len(spec["containers"]) == 1
    result: Doc = spec["containers"][0]
    return result


def env(ds: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(ds).get("env", [])}


def mounts(ds: Doc) -> dict[str, Doc]:
    return {m["mountPath"]: m for m in container(ds).get("volumeMounts", [])}


def volumes(ds: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in ds["spec"]["template"]["spec"].get("volumes", [])}


def validate(doc: Doc) -> None:
    """`doc` against the 1.36 schemas, and a device-plugin mode object against 1.33's too."""
    kubernetes_validate.validate(doc, DRA_KUBE_VERSION, strict=True)
    if not doc["apiVersion"].startswith(("resource.k8s.io/", "admissionregistration.k8s.io/")):
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def rules(docs: list[Doc], kind: str, name: str) -> dict[str, set[str]]:
    """resource -> verbs of one Role/ClusterRole."""
    out: dict[str, set[str]] = {}
    for rule in one(docs, kind, name)["rules"]:
        for resource in rule["resources"]:
            out.setdefault(resource, set()).update(rule["verbs"])
    return out


# --- every scenario ------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_passes_schema_and_renders_valid_objects(chart: Any, scenario: str) -> None:
    vals = values(scenario)
    chart.validate_schema(vals)
    docs = render(chart, vals)
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"].count("/") == 1
            assert doc["metadata"]["name"] and doc["metadata"]["namespace"]
            assert isinstance(doc["spec"], dict)
            continue
        validate(doc)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_daemonset_is_least_privilege_and_tolerates_gpu_taints(
    chart: Any, scenario: str
) -> None:
    for ds in (d for d in render(chart, values(scenario)) if d["kind"] == "DaemonSet"):
        sc = container(ds)["securityContext"]
        assert sc["privileged"] is False
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["capabilities"].get("add", []) in ([], ["SYS_ADMIN"])
        pod = ds["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == "system-node-critical"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        assert {"key": "CriticalAddonsOnly", "operator": "Exists"} in pod["tolerations"]
        for volume in volumes(ds).values():
            # No host path beyond the ones the design names.
            if "hostPath" in volume:
                assert volume["hostPath"]["path"] in {
                    "/var/lib/kubelet/device-plugins",
                    "/var/lib/kubelet/plugins_registry",
                    "/var/lib/kubelet/plugins/gpu.nvidia.com",
                    "/var/lib/kubelet/plugins/gpu.amd.com",
                    "/",
                    "/run/nvidia/driver",
                    "/var/run/cdi",
                    "/run/nvidia/mps",
                    "/run/nvidia/mps/shm",
                    "/sys",
                    # Read only: process cgroups and the kubelet's PodResources API, to
                    # tell which container uses what on the GPUs.
                    "/proc",
                    "/var/lib/kubelet/pod-resources",
                    "/etc/kubernetes/node-feature-discovery/features.d",
                }, volume


def test_values_have_a_comment_on_every_key() -> None:
    """Each key has a comment right above it; keys inside Kubernetes-shaped data don't."""
    data_keys = {"affinity", "tolerations", "securityContext", "podSecurityContext"}
    data_keys |= {"updateStrategy", "resources", "podAnnotations", "imagePullSecrets"}
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match[1]), match[2]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inside_data = any(k in data_keys for _, k in stack)
        stack.append((indent, key))
        if inside_data:
            continue
        assert lines[i - 1].strip().startswith("#"), f"values.yaml:{i + 1} {key!r} has no comment"


def test_binary_owned_values_default_to_null(chart: Any) -> None:
    vals = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in (
        "migStrategy",
        "failOnInitError",
        "deviceListStrategy",
        "deviceIDStrategy",
        "nvidiaDriverRoot",
        "compatWithCPUManager",
        "runtimeClassName",
    ):
        assert vals[key] is None, key
    # ... and null values produce no env var at all.
    plugin = env(one(render(chart), "DaemonSet", "kubegpu"))
    for var in ("MIG_STRATEGY", "FAIL_ON_INIT_ERROR", "DEVICE_LIST_STRATEGY", "NVIDIA_DRIVER_ROOT"):
        assert var not in plugin


def test_schema_rejects_bad_values(chart: Any) -> None:
    for bad in (
        {"migStrategy": "sideways"},
        {"deviceListStrategy": ["envvar", "carrier-pigeon"]},
        {"gfd": {"sleepInterval": "often"}},
        {"metrics": {"port": 0}},
    ):
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(bad)


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        ({"migStrategyy": "mixed"}, "unknown value 'migStrategyy'; did you mean 'migStrategy'?"),
        ({"MigStrategy": "mixed"}, "unknown value 'MigStrategy'; did you mean 'migStrategy'?"),
        ({"gfd": {"enabeld": True}}, "unknown value 'gfd.enabeld'; did you mean 'gfd.enabled'?"),
        (
            {"probes": {"liveness": {"periodSecond": 5}}},
            "unknown value 'probes.liveness.periodSecond'; "
            "did you mean 'probes.liveness.periodSeconds'?",
        ),
        (
            {"unknownKey": 1},
            "unknown value 'unknownKey': this chart has no such value; "
            "see the chart's values.yaml (helm show values)",
        ),
        (
            {"imag": {"tagg": "v1"}, "dra": {"mode": "x"}},
            "unknown values 'dra.mode', 'imag' (did you mean 'image'?); "
            "see the chart's values.yaml (helm show values)",
        ),
    ],
)
def test_an_unknown_value_is_refused_naming_the_value_it_is_closest_to(
    chart: Any, given: dict[str, Any], refusal: str
) -> None:
    chart.validate_schema(given)  # types are the schema's; names are the template's
    with pytest.raises(helm_python.HelmRenderError) as info:
        render(chart, given)
    assert str(info.value).endswith(refusal), str(info.value)


def test_values_that_take_any_keys_still_do(chart: Any) -> None:
    """Kubernetes data, maps of names and NVIDIA's nfd.* settings are not checked."""
    given = {
        "nfd": {"worker": {"tolerations": []}},
        "config": {"map": {"any-name": "version: v1\n"}},
        "selectorLabelsOverride": {"app": "gpu"},
        "podAnnotations": {"example.com/a": "b"},
        "securityContext": {"privileged": False},
        "metrics": {"serviceMonitor": {"additionalLabels": {"release": "prom"}}},
        "global": {"imageRegistry": "registry.example.com"},
    }
    chart.validate_schema(given)
    assert render(chart, given)


def known_tree(node: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any] | None:
    """The keys of a schema object whose keys the chart checks: one with `properties` and
    no `additionalProperties`; None for a value that takes any keys."""
    while "$ref" in node:
        node = definitions[node["$ref"].rsplit("/", 1)[1]]
    if "properties" not in node or "additionalProperties" in node:
        return None
    return {key: known_tree(sub, definitions) for key, sub in node["properties"].items()}


def test_the_values_the_chart_knows_are_the_schemas() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    text = (CHART / "templates" / "_values.tpl").read_text()
    body = text.split('{{- define "kubegpu.knownValues" -}}\n', 1)[1].split("{{- end -}}", 1)[0]
    assert yaml.safe_load(body) == known_tree(schema, schema["definitions"])
    # Every object of the schema is either checked by the chart or open by its own word.
    assert known_tree(schema["properties"]["nfd"], schema["definitions"]) is None
    assert schema["properties"]["nfd"]["additionalProperties"] is True


def test_helm_lint_is_clean() -> None:
    report = helm_python.lint(str(CHART), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- defaults --------------------------------------------------------------------------


def test_defaults_plugin_daemonset(chart: Any) -> None:
    docs = render(chart)
    ds = one(docs, "DaemonSet", "kubegpu")
    c = container(ds)
    assert c["command"] == [*HUP_IGNORED, "kubegpu"] and c["args"] == ["serve"]
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    exprs = [t["matchExpressions"][0] for t in terms]
    assert {"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In",
            "values": ["true"]} in exprs  # fmt: skip
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in exprs
    assert {"key": "nvidia.com/gpu.product", "operator": "Exists"} in exprs
    e = env(ds)
    assert e["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert e["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert e["HEALTH_PORT"] == "8081"
    assert e["METRICS_PORT"] == "9400"
    assert e["DEVICE_PLUGIN_PATH"] == "/var/lib/kubelet/device-plugins"
    assert "MPS_ROOT" not in e and "CONFIG_FILE_SRCDIR" not in e
    m = mounts(ds)
    assert m["/var/lib/kubelet/device-plugins"].get("readOnly") is not True
    # The host's driver is handed in by the NVIDIA runtime: no host `/` in the pod.
    assert "/driver-root" not in m and "CONTAINER_DRIVER_ROOT" not in e
    assert [v["hostPath"]["path"] for v in volumes(ds).values() if "hostPath" in v] == [
        "/var/lib/kubelet/device-plugins",
        "/proc",
        "/var/lib/kubelet/pod-resources",
    ]
    # Who uses what on the GPUs (with metrics on): read only, found where PROC_ROOT says.
    assert m["/host/proc"]["readOnly"] is True and e["PROC_ROOT"] == "/host/proc"
    assert m["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    assert "/var/run/cdi" not in m and "/dev/shm" not in m
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert {"name": "health", "containerPort": 8081, "protocol": "TCP"} in c["ports"]
    assert "add" not in c["securityContext"]["capabilities"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # A memory limit by default, above the measured RSS (docs/performance.md).
    assert c["resources"]["limits"]["memory"] == "256Mi"
    assert c["resources"]["requests"]["memory"] == "96Mi"
    # Labeller is opt-in, as GFD is in NVIDIA's chart.
    assert not [d for d in docs if d["metadata"]["name"].endswith("-labeller")]


def test_defaults_rbac_is_create_node_events_only(chart: Any) -> None:
    """Node events are all the plugin writes, and they live in `default` (as the kubelet's):
    a Role there, `create` on core events; nothing cluster-wide, no other group or verb."""
    from kubegpu.events import NAMESPACE

    docs = render(chart)
    events = one(docs, "Role", "kubegpu-events")
    assert events["metadata"]["namespace"] == NAMESPACE == "default"
    assert events["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    binding = one(docs, "RoleBinding", "kubegpu-events")
    assert binding["metadata"]["namespace"] == "default"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kubegpu-events",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kubegpu", "namespace": "kube-system"}
    ]
    assert not [d for d in docs if d["kind"].startswith("ClusterRole")]
    # Named configs follow the node's label: then the plugin reads Nodes, and only that.
    with_configs = render(chart, values("seed-003-values.yaml"))
    assert rules(with_configs, "ClusterRole", "kubegpu") == {"nodes": {"get", "list", "watch"}}
    assert one(with_configs, "ClusterRoleBinding", "kubegpu")["subjects"] == binding["subjects"]
    assert one(docs, "ServiceAccount", "kubegpu")


def test_metrics_service_selects_plugin_pods(chart: Any) -> None:
    docs = render(chart)
    svc = one(docs, "Service", "kubegpu-metrics")
    ds = one(docs, "DaemonSet", "kubegpu")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    off = render(chart, {"metrics": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "Service"]
    assert "METRICS_PORT" not in env(one(off, "DaemonSet", "kubegpu"))


# --- seed 003 --------------------------------------------------------------------------


def test_seed_003_values_install_with_time_slicing_config(chart: Any) -> None:
    docs = render(chart, values("seed-003-values.yaml"))
    cm = one(docs, "ConfigMap", "kubegpu-config")
    config = yaml.safe_load(cm["data"]["default"])
    assert config["sharing"]["timeSlicing"]["resources"] == [
        {"name": "nvidia.com/gpu", "replicas": 20}
    ]
    assert config["sharing"]["timeSlicing"]["failRequestsGreaterThanOne"] is True
    ds = one(docs, "DaemonSet", "kubegpu")
    e = env(ds)
    assert e["CONFIG_FILE_SRCDIR"] == "/available-configs"
    assert e["DEFAULT_CONFIG"] == "default"
    assert e["FALLBACK_STRATEGIES"] == "named,single"
    assert mounts(ds)["/available-configs"]["readOnly"] is True
    assert volumes(ds)["available-configs"]["configMap"]["name"] == "kubegpu-config"
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "Exists"}]}
    ]


def test_seed_003_time_slicing_config_is_valid_for_kubegpu() -> None:
    from kubegpu.config import parse_config

    text = values("seed-003-values.yaml")["config"]["map"]["default"]
    cfg = parse_config(text)
    assert cfg.sharing.time_slicing is not None
    assert cfg.sharing.time_slicing.resources[0].replicas == 20


def test_config_changes_roll_the_pods(chart: Any) -> None:
    def checksum(vals: dict[str, Any]) -> str:
        ds = one(render(chart, vals), "DaemonSet", "kubegpu")
        result: str = ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return result

    seed = values("seed-003-values.yaml")
    changed = json.loads(json.dumps(seed))
    changed["config"]["map"]["default"] = changed["config"]["map"]["default"].replace("20", "10")
    assert checksum(seed) != checksum(changed)


def test_external_configmap_is_mounted_not_created(chart: Any) -> None:
    docs = render(chart, {"config": {"name": "my-configs", "default": "a100"}})
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    ds = one(docs, "DaemonSet", "kubegpu")
    assert volumes(ds)["available-configs"]["configMap"]["name"] == "my-configs"
    assert env(ds)["DEFAULT_CONFIG"] == "a100"


# --- CDI, MPS, MIG, CPU manager ----------------------------------------------------------


def test_cdi_scenario_mounts_cdi_dir_and_passes_strategies(chart: Any) -> None:
    ds = one(render(chart, values("cdi-values.yaml")), "DaemonSet", "kubegpu")
    e = env(ds)
    assert e["DEVICE_LIST_STRATEGY"] == "cdi-cri,cdi-annotations"
    assert e["DEVICE_ID_STRATEGY"] == "uuid"
    assert e["NVIDIA_CTK_PATH"] == "/usr/local/nvidia/toolkit/nvidia-ctk"
    assert e["NVIDIA_DRIVER_ROOT"] == "/run/nvidia/driver"
    assert mounts(ds)["/var/run/cdi"].get("readOnly") is not True
    assert volumes(ds)["driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"


def test_mps_scenario_mounts_mps_dirs_and_labeller_uses_node_feature_api(chart: Any) -> None:
    docs = render(chart, values("mps-values.yaml"))
    ds = one(docs, "DaemonSet", "kubegpu")
    assert env(ds)["MPS_ROOT"] == "/run/nvidia/mps"
    # The MPS binaries come from the NVIDIA runtime's compute capability.
    assert env(ds)["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "NVIDIA_DRIVER_CAPABILITIES" not in env(one(render(chart), "DaemonSet", "kubegpu"))
    m = mounts(ds)
    assert "/run/nvidia/mps" in m and "/dev/shm" in m
    assert volumes(ds)["mps-shm"]["hostPath"]["path"] == "/run/nvidia/mps/shm"

    labeller = one(docs, "DaemonSet", "kubegpu-labeller")
    le = env(labeller)
    assert le["GFD_USE_NODE_FEATURE_API"] == "true"
    assert "GFD_OUTPUT_FILE" not in le
    # The named config the node's label picks (mps4, the only one), not a pinned file.
    assert "CONFIG_FILE" not in le
    assert le["CONFIG_FILE_SRCDIR"] == "/available-configs"
    assert le["DEFAULT_CONFIG"] == "mps4"
    assert le["MPS_ROOT"] == "/run/nvidia/mps"
    pod = labeller["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is True
    # NodeFeature objects, and its own pod for their owner reference.
    assert rules(docs, "Role", "kubegpu-labeller") == {
        "nodefeatures": {"get", "create", "update"},
        "pods": {"get"},
    }
    # Named configs: it follows its Node's config label, read-only.
    assert rules(docs, "ClusterRole", "kubegpu-labeller") == {"nodes": {"get", "list", "watch"}}

    sm = one(docs, "ServiceMonitor", "kubegpu")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    svc = one(docs, "Service", "kubegpu-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_mig_adds_sys_admin_and_monitor_devices_only(chart: Any) -> None:
    for vals in (
        {"migStrategy": "mixed"},
        {"config": {"map": {"mig": "version: v1\nflags:\n  migStrategy: single\n"}}},
    ):
        ds = one(render(chart, vals), "DaemonSet", "kubegpu")
        caps = container(ds)["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
        assert env(ds)["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    ds = one(render(chart, {"migStrategy": "none"}), "DaemonSet", "kubegpu")
    assert "add" not in container(ds)["securityContext"]["capabilities"]
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in env(ds)


def test_compat_with_cpu_manager_is_privileged_and_passes_device_specs(chart: Any) -> None:
    ds = one(render(chart, {"compatWithCPUManager": True}), "DaemonSet", "kubegpu")
    assert container(ds)["securityContext"] == {"privileged": True}
    assert env(ds)["PASS_DEVICE_SPECS"] == "true"


# --- deployment defaults -------------------------------------------------------------------


def test_resources_default_to_a_memory_limit_unless_given_or_mps(chart: Any) -> None:
    docs = render(chart, {"gfd": {"enabled": True}})
    for name in ("kubegpu", "kubegpu-labeller"):
        res = container(one(docs, "DaemonSet", name))["resources"]
        assert res == {"requests": {"cpu": "10m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}}
    # MPS daemons and servers share the plugin's cgroup: no default limit to OOM them.
    mps = container(one(render(chart, values("mps-values.yaml")), "DaemonSet", "kubegpu"))
    assert "limits" not in mps["resources"] and mps["resources"]["requests"]["memory"] == "96Mi"
    given = {"limits": {"memory": "512Mi"}}
    ds = one(render(chart, {"resources": given}), "DaemonSet", "kubegpu")
    assert container(ds)["resources"] == given


def test_no_host_root_mount_unless_a_driver_root_or_cdi_needs_it(chart: Any) -> None:
    for scenario in SCENARIOS:
        for ds in (d for d in render(chart, values(scenario)) if d["kind"] == "DaemonSet"):
            paths = {v["hostPath"]["path"] for v in volumes(ds).values() if "hostPath" in v}
            assert "/" not in paths, (scenario, ds["metadata"]["name"])
    ds = one(render(chart, {"deviceListStrategy": ["cdi-cri"]}), "DaemonSet", "kubegpu")
    assert volumes(ds)["driver-root"]["hostPath"]["path"] == "/"
    assert env(ds)["CONTAINER_DRIVER_ROOT"] == "/driver-root"


def test_empty_security_context_keeps_least_privilege(chart: Any) -> None:
    """`{}` (as in NVIDIA's values) means the default, not "no restrictions"."""
    docs = render(chart, {"securityContext": {}, "gfd": {"enabled": True, "securityContext": {}}})
    for name in ("kubegpu", "kubegpu-labeller"):
        sc = container(one(docs, "DaemonSet", name))["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] is True


# --- labeller ----------------------------------------------------------------------------


def test_labeller_only_patches_nodes_with_minimal_rbac(chart: Any) -> None:
    docs = render(chart, values("labeller-only-values.yaml"))
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "DaemonSet"] == ["kubegpu-labeller"]
    ds = one(docs, "DaemonSet", "kubegpu-labeller")
    c = container(ds)
    assert c["command"] == [*HUP_IGNORED, "kubegpu"] and c["args"] == ["labels"]
    e = env(ds)
    assert e["GFD_NODE_PATCH"] == "true"
    assert e["GFD_NO_TIMESTAMP"] == "true"
    assert e["GFD_SLEEP_INTERVAL"] == "5m"
    assert e["MIG_STRATEGY"] == "mixed"
    assert e["FAIL_ON_INIT_ERROR"] == "false"  # runs on CPU nodes too
    assert e["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert rules(docs, "ClusterRole", "kubegpu-labeller") == {"nodes": {"get", "patch"}}
    assert mounts(ds)["/host/sys"]["readOnly"] is True
    assert "/etc/kubernetes/node-feature-discovery/features.d" not in mounts(ds)
    # Runs on every node (no GPU affinity), so gpu.present can appear in the first place.
    assert "affinity" not in ds["spec"]["template"]["spec"]


def test_labeller_file_mode_needs_no_api_access(chart: Any) -> None:
    docs = render(chart, {"gfd": {"enabled": True}})
    ds = one(docs, "DaemonSet", "kubegpu-labeller")
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert env(ds)["GFD_OUTPUT_FILE"] == "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    features = mounts(ds)["/etc/kubernetes/node-feature-discovery/features.d"]
    assert features.get("readOnly") is not True
    assert not [d for d in docs if "labeller" in d["metadata"]["name"] and "Role" in d["kind"]]


def test_labeller_env_names_and_values_are_ones_kubegpu_labels_accepts(chart: Any) -> None:
    """Every env var the chart gives the labeller is a `kubegpu labels` flag's, with a value
    it parses (downward-API values stand in as the kubelet fills them)."""
    from kubegpu.cli.labels import labels
    from kubegpu.cli.options import env_options, given, parse

    options = env_options(labels)
    known = {name for opt in options for name in opt.envs}
    downward = {
        "spec.nodeName": "gpu-node-1",
        "metadata.namespace": "kube-system",
        "metadata.name": "kubegpu-labeller-x7k2p",
    }
    everything = {
        "gfd": {"enabled": True, "nodePatch": True, "noTimestamp": False, "sleepInterval": "0"},
        "migStrategy": "single",
        "nvidiaDriverRoot": "/run/nvidia/driver",
        "config": {"name": "configs", "default": "a", "fallbackStrategies": ["named", "empty"]},
        "mps": {"enabled": True},
        "logFormat": "json",
    }
    cases = [values(s) for s in SCENARIOS if "gfd" in values(s)]
    cases += [everything, {"gfd": {"enabled": True}, "sleepInterval": 60_000_000_000}]
    for vals in cases:
        ds = one(render(chart, vals), "DaemonSet", "kubegpu-labeller")
        chart_env: dict[str, str] = {}
        for e in container(ds)["env"]:
            assert e["name"] in known, e
            ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            chart_env[e["name"]] = downward[ref] if ref else e["value"]
        parse(labels, [], chart_env)  # every value parses
        # Every variable the chart gives sets its option; none is read as unset.
        assert {opt.name for opt in options if set(opt.envs) & set(chart_env)} == given(
            labels, [], chart_env
        )


NAMED_CONFIG_ENV = ("CONFIG_FILE_SRCDIR", "DEFAULT_CONFIG", "FALLBACK_STRATEGIES", "NODE_LABEL")


@pytest.mark.parametrize(
    "config",
    [
        {"map": {"default": "version: v1\n", "mig": "version: v1\n"}},
        {"map": {"only": "version: v1\n"}},
        {
            "name": "site-configs",
            "default": "a100",
            "fallbackStrategies": ["named", "empty"],
            "nodeLabel": "example.com/gpu-config",
        },
    ],
    ids=["map-named-default", "map-single", "external-configmap"],
)
@pytest.mark.parametrize("delivery", [{}, {"nodePatch": True}, {"useNodeFeatureAPI": True}])
def test_labeller_follows_named_configs_as_the_plugin_does(
    chart: Any, config: dict[str, Any], delivery: dict[str, Any]
) -> None:
    """The labeller gets the plugin's named-config wiring (same directory, default,
    fallbacks, node label, ConfigMap), so its labels describe the config the plugin serves."""
    docs = render(chart, {"config": config, "gfd": {"enabled": True, **delivery}})
    plugin, labeller = one(docs, "DaemonSet", "kubegpu"), one(docs, "DaemonSet", "kubegpu-labeller")
    pe, le = env(plugin), env(labeller)
    for var in NAMED_CONFIG_ENV:
        assert le.get(var) == pe.get(var), var
    assert le["CONFIG_FILE_SRCDIR"] == "/available-configs" and "CONFIG_FILE" not in le
    assert "DEFAULT_CONFIG" in le
    assert mounts(labeller)["/available-configs"] == mounts(plugin)["/available-configs"]
    assert volumes(labeller)["available-configs"] == volumes(plugin)["available-configs"]
    assert le["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert le["NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert le["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # It watches its Node's label, so it needs a token even when it writes a file.
    assert labeller["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    checksums = [ds["spec"]["template"]["metadata"]["annotations"] for ds in (plugin, labeller)]
    assert checksums[0]["checksum/config"] == checksums[1]["checksum/config"]


def test_labeller_without_named_configs_gets_no_config_wiring(chart: Any) -> None:
    ds = one(render(chart, {"gfd": {"enabled": True}}), "DaemonSet", "kubegpu-labeller")
    e = env(ds)
    assert not {*NAMED_CONFIG_ENV, "CONFIG_FILE"} & set(e)
    assert "available-configs" not in volumes(ds) and "/available-configs" not in mounts(ds)
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "annotations" not in ds["spec"]["template"]["metadata"]


@pytest.mark.parametrize(
    ("delivery", "named", "cluster_rules", "namespace_rules"),
    [
        ({}, False, None, None),
        ({}, True, {"nodes": {"get", "list", "watch"}}, None),
        ({"nodePatch": True}, False, {"nodes": {"get", "patch"}}, None),
        ({"nodePatch": True}, True, {"nodes": {"get", "list", "watch", "patch"}}, None),
        (
            {"useNodeFeatureAPI": True},
            False,
            None,
            {"nodefeatures": {"get", "create", "update"}, "pods": {"get"}},
        ),
        (
            {"useNodeFeatureAPI": True},
            True,
            {"nodes": {"get", "list", "watch"}},
            {"nodefeatures": {"get", "create", "update"}, "pods": {"get"}},
        ),
    ],
    ids=["file", "file-named", "patch", "patch-named", "nodefeature", "nodefeature-named"],
)
def test_labeller_rbac_is_what_its_delivery_and_named_configs_use(
    chart: Any,
    delivery: dict[str, Any],
    named: bool,
    cluster_rules: dict[str, set[str]] | None,
    namespace_rules: dict[str, set[str]] | None,
) -> None:
    """Nodes are read (get/list/watch) only to follow the named-config label; pods only for
    the NodeFeature owner reference, in the labeller's own namespace."""
    vals: dict[str, Any] = {"gfd": {"enabled": True, **delivery}}
    if named:
        vals["config"] = {"name": "site-configs", "default": "a"}
    docs = render(chart, vals)
    subject = [{"kind": "ServiceAccount", "name": "kubegpu-labeller", "namespace": "kube-system"}]
    for kind, expected in (("ClusterRole", cluster_rules), ("Role", namespace_rules)):
        found = [
            d for d in docs if d["kind"] == kind and d["metadata"]["name"] == "kubegpu-labeller"
        ]
        if expected is None:
            assert not found, kind
            continue
        assert rules(docs, kind, "kubegpu-labeller") == expected
        binding = one(docs, f"{kind}Binding", "kubegpu-labeller")
        assert binding["subjects"] == subject
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": kind,
            "name": "kubegpu-labeller",
        }
    if namespace_rules:
        assert one(docs, "Role", "kubegpu-labeller")["metadata"]["namespace"] == "kube-system"


# --- sleepInterval ---------------------------------------------------------------------

#: Durations as NVIDIA's chart passes them on and kubegpu's config parser reads them,
#: and strings neither accepts.
SLEEP_INTERVALS: list[Any] = [
    "0", "+0", "-0", "0s", "60s", "1m", "1h30m", "1.5h", ".5s", "5.s", "-1s", "+2m",
    "300ms", "10us", "10\u00b5s", "10\u03bcs", "7ns", "infinite", 0, 60_000_000_000, -5,
    "often", "60", "", "1d", "s", ".s", "1.2.3s", "+infinite", "INFINITE", "1 s", " 60s",
    "60S",
]  # fmt: skip


@pytest.mark.parametrize("value", SLEEP_INTERVALS, ids=repr)
@pytest.mark.parametrize("key", ["gfd", "top-level"])
def test_sleep_interval_schema_accepts_what_the_config_parser_reads(
    chart: Any, value: Any, key: str
) -> None:
    """The schema takes exactly the strings and integers (nanoseconds) a config file's
    sleepInterval takes, and the labeller is handed the same duration."""
    from kubegpu.config.names import parse_go_duration

    try:
        expected_ns: int | None = max(0, parse_go_duration(value))
    except ValueError:
        expected_ns = None
    vals: dict[str, Any] = (
        {"gfd": {"enabled": True, "sleepInterval": value}}
        if key == "gfd"
        else {"gfd": {"enabled": True}, "sleepInterval": value}
    )
    if expected_ns is None:
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(vals)
        return
    chart.validate_schema(vals)
    given = env(one(render(chart, vals), "DaemonSet", "kubegpu-labeller"))["GFD_SLEEP_INTERVAL"]
    assert max(0, parse_go_duration(given)) == expected_ns
    # A bare number is nanoseconds only in YAML; as a flag it would be refused.
    assert not given.lstrip("+-").isdigit()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("0", 0.0), ("0s", 0.0), ("60s", 60.0), ("1m", 60.0), (90_000_000_000, 90.0)],
    ids=repr,
)
def test_nvidia_style_sleep_intervals_reach_kubegpu_labels_as_durations(
    chart: Any, value: Any, seconds: float
) -> None:
    """NVIDIA's chart passes `0` and integers through; `kubegpu labels` gets a duration with
    a unit for both (Go's flag parser, like ours, takes no bare number but `0`)."""
    from kubegpu.labeller import parse_duration

    vals = {"gfd": {"enabled": True}, "sleepInterval": value}
    given = env(one(render(chart, vals), "DaemonSet", "kubegpu-labeller"))["GFD_SLEEP_INTERVAL"]
    assert parse_duration(given) == pytest.approx(seconds)


def test_null_sleep_interval_leaves_the_binary_default(chart: Any) -> None:
    ds = one(render(chart, {"gfd": {"enabled": True}}), "DaemonSet", "kubegpu-labeller")
    assert "GFD_SLEEP_INTERVAL" not in env(ds)


def test_plugin_env_names_and_values_are_ones_kubegpu_serve_accepts(chart: Any) -> None:
    """Every env var the chart gives the plugin is a `kubegpu serve` flag's, with a value it
    parses; the rest are read by the NVIDIA runtime or NVML, not by kubegpu."""
    from kubegpu.cli.options import env_options
    from kubegpu.cli.serve import serve

    flags = {name: opt for opt in env_options(serve) for name in opt.envs}
    outside = {
        "POD_NAMESPACE",
        "POD_IP",
        "NVIDIA_MIG_MONITOR_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
    }
    everything = {
        "gdsEnabled": True,
        "mofedEnabled": False,
        "gdrcopyEnabled": True,
        "nvidiaDevRoot": "/run/nvidia/dev",
        "cdi": {"nvidiaHookPath": "/usr/bin/nvidia-cdi-hook"},
        "migStrategy": "mixed",
        "failOnInitError": False,
        "deviceListStrategy": "envvar,cdi-cri",
        "config": {"name": "configs", "default": "a", "fallbackStrategies": ["empty"]},
        "mps": {"enabled": True},
        "backend": "amd",
        "resourceNamingStrategy": "mixed",
        "logFormat": "json",
    }
    scenarios = [values(s) for s in SCENARIOS if "labeller" not in s]
    for vals in [*scenarios, everything]:
        for e in container(one(render(chart, vals), "DaemonSet", "kubegpu"))["env"]:
            if e["name"] in outside or "valueFrom" in e:
                continue
            if e["name"] in DRA_FLAGS and e["name"] not in flags:
                # `serve --mode` and the kubelet directories come with the DRA kubelet
                # plugin; a build without them still gets a mode or an absolute path.
                assert e["value"] in ("plugin", "dra") or e["value"].startswith("/"), e
                continue
            assert e["name"] in flags, e
            option = flags[e["name"]]
            option.type.convert(e["value"], option, None)


def test_log_format_reaches_the_plugin_and_the_labeller_only_when_set(chart: Any) -> None:
    gfd = {"gfd": {"enabled": True}}
    for ds in ("kubegpu", "kubegpu-labeller"):
        assert "LOG_FORMAT" not in env(one(render(chart, gfd), "DaemonSet", ds))
        json_logs = env(one(render(chart, {**gfd, "logFormat": "json"}), "DaemonSet", ds))
        assert json_logs["LOG_FORMAT"] == "json"
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema({"logFormat": "yaml"})
    chart.validate_schema({"logFormat": None})


def test_handover_rolls_with_surge_and_starts_serve_with_handover(chart: Any) -> None:
    plain = one(render(chart), "DaemonSet", "kubegpu")
    assert plain["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    assert "HANDOVER" not in env(plain)
    vals = values("handover-values.yaml")
    ds = one(render(chart, vals), "DaemonSet", "kubegpu")
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert env(ds)["HANDOVER"] == "true"
    # The labeller has nothing to hand over: its own strategy stands.
    both = render(chart, {**vals, "gfd": {"enabled": True}})
    assert "rollingUpdate" not in one(both, "DaemonSet", "kubegpu-labeller")["spec"].get(
        "updateStrategy", {}
    )


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"mps": {"enabled": True}}, "MPS"),
        ({"devicePlugin": {"enableHostNetwork": True}}, "enableHostNetwork"),
    ],
    ids=["mps", "host-network"],
)
def test_handover_refuses_what_two_pods_on_a_node_cannot_share(
    chart: Any, extra: dict[str, Any], words: str
) -> None:
    vals = {"handover": {"enabled": True}, **extra}
    chart.validate_schema(vals)
    with pytest.raises(helm_python.HelmError) as failure:
        render(chart, vals)
    reason = str(failure.value)
    assert "handover.enabled" in reason and words in reason


# --- static manifests --------------------------------------------------------------------


def _render_static_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "render_static", REPO / "deployments" / "render-static.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_static_manifests_are_in_sync_with_the_chart() -> None:
    module = _render_static_module()
    for name, text in module.render_all().items():
        path = REPO / "deployments" / "static" / name
        assert path.exists(), f"missing {path}; run python deployments/render-static.py"
        assert path.read_text() == text, f"{name} is stale; run python deployments/render-static.py"


def test_static_manifests_are_valid_and_carry_no_helm_labels() -> None:
    for path in sorted((REPO / "deployments" / "static").glob("*.yaml")):
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            validate(doc)
            labels = doc["metadata"].get("labels", {})
            assert "helm.sh/chart" not in labels and "app.kubernetes.io/managed-by" not in labels


def test_resource_naming_strategy_reaches_the_plugin_and_only_when_set(chart: Any) -> None:
    ds = one(render(chart, {"resourceNamingStrategy": "mixed"}), "DaemonSet", "kubegpu")
    assert env(ds)["RESOURCE_NAMING_STRATEGY"] == "mixed"
    assert "RESOURCE_NAMING_STRATEGY" not in env(one(render(chart, {}), "DaemonSet", "kubegpu"))


# --- mode: dra ---------------------------------------------------------------------------

#: NVIDIA's DeviceClass selectors, verbatim: kubernetes-sigs/dra-driver-nvidia-gpu @ 95932046
#: (main), deployments/helm/dra-driver-nvidia-gpu/templates/deviceclass-gpu.yaml (with
#: `extendedResourceName: nvidia.com/gpu` on resource.k8s.io/v1) and deviceclass-mig.yaml.
NVIDIA_GPU_CEL = (
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
)
NVIDIA_MIG_CEL = (
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"
)


def test_dra_mode_installs_nvidias_device_classes(chart: Any) -> None:
    docs = render(chart, values("dra-values.yaml"))
    gpu = one(docs, "DeviceClass", "gpu.nvidia.com")
    mig = one(docs, "DeviceClass", "mig.nvidia.com")
    assert gpu["spec"] == {
        "selectors": [{"cel": {"expression": NVIDIA_GPU_CEL}}],
        "extendedResourceName": "nvidia.com/gpu",
    }
    assert mig["spec"] == {"selectors": [{"cel": {"expression": NVIDIA_MIG_CEL}}]}
    assert gpu["apiVersion"] == mig["apiVersion"] == "resource.k8s.io/v1"


def test_dra_mode_installs_a_class_for_gpu_slices_sized_by_memory(chart: Any) -> None:
    """`gpu-slice.nvidia.com` picks the devices a sharing entry with `sizing` publishes
    (they name their limits), not whole GPUs nor GPUs shared without a size; the claim
    names its size in `capacity.requests.memory`, no CEL."""
    from kubegpu.config import parse_config
    from kubegpu.devices.simulated import SimulatedBackend
    from kubegpu.dra.slices import device_body, dra_devices
    from kubegpu.resources import build_resources
    from tests.rig.dra.scheduler import Device, Selector

    docs = render(chart, values("dra-values.yaml"))
    cls = one(docs, "DeviceClass", "gpu-slice.nvidia.com")
    validate(cls)
    assert "extendedResourceName" not in cls["spec"]
    [selector] = [Selector(s["cel"]["expression"]) for s in cls["spec"]["selectors"]]
    inventory = SimulatedBackend.load("h100-8").discover()

    def picked(sharing: str) -> set[str]:
        config = parse_config(f"version: v1\nflags: {{mpsRoot: /run/nvidia/mps}}\n{sharing}")
        return {
            d.name
            for d in dra_devices("gpu.nvidia.com", build_resources(inventory, config))
            if selector.matches(
                Device(
                    "gpu.nvidia.com", "n", d.name, dict(device_body(d, inventory, "gpu.nvidia.com"))
                )
            )
        }

    sized = "{name: gpu, replicas: 4, devices: [0], rename: gpu.sized, sizing: {}}"
    assert picked(f"sharing: {{mps: {{resources: [{sized}]}}}}") == {"gpu-0"}
    assert picked("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}") == set()
    assert picked("") == set()


def host_paths(ds: Doc) -> dict[str, str]:
    """host path -> hostPath type of a DaemonSet's volumes."""
    return {
        v["hostPath"]["path"]: v["hostPath"]["type"]
        for v in volumes(ds).values()
        if "hostPath" in v
    }


def test_dra_mode_mounts_its_own_driver_dir_the_registrar_and_cdi_only(chart: Any) -> None:
    """The driver's own directory in the kubelet's plugins directory, not all of it: other
    drivers' sockets (which would answer this pod's calls) and state stay out of the pod."""
    ds = one(render(chart, values("dra-values.yaml")), "DaemonSet", "kubegpu")
    assert env(ds)["KUBEGPU_MODE"] == "dra"
    assert env(ds)["KUBELET_REGISTRAR_DIRECTORY_PATH"] == "/var/lib/kubelet/plugins_registry"
    assert env(ds)["KUBELET_PLUGINS_DIRECTORY_PATH"] == "/var/lib/kubelet/plugins"
    assert "DEVICE_PLUGIN_PATH" not in env(ds)
    assert host_paths(ds) == {
        "/var/lib/kubelet/plugins_registry": "Directory",
        "/var/lib/kubelet/plugins/gpu.nvidia.com": "DirectoryOrCreate",
        # Every claim's devices reach the runtime through a CDI spec.
        "/var/run/cdi": "DirectoryOrCreate",
        # With metrics on, who uses what: processes' cgroups and the kubelet's pod resources.
        "/proc": "Directory",
        "/var/lib/kubelet/pod-resources": "DirectoryOrCreate",
    }
    # Each at the host's own path: the kubelet dials the socket path the driver names.
    assert {m: v.get("readOnly", False) for m, v in mounts(ds).items()} == {
        "/var/lib/kubelet/plugins_registry": False,
        "/var/lib/kubelet/plugins/gpu.nvidia.com": False,
        "/var/run/cdi": False,
        "/host/proc": True,
        "/var/lib/kubelet/pod-resources": True,
        "/tmp": False,
        "/available-configs": True,
    }
    amd = one(render(chart, {"mode": "dra", "backend": "amd"}), "DaemonSet", "kubegpu")
    assert "/var/lib/kubelet/plugins/gpu.amd.com" in host_paths(amd)
    moved = {"mode": "dra", "dra": {"kubeletPluginsDirectoryPath": "/data/kubelet/plugins/"}}
    ds = one(render(chart, moved), "DaemonSet", "kubegpu")
    assert env(ds)["KUBELET_PLUGINS_DIRECTORY_PATH"] == "/data/kubelet/plugins/"
    assert "/data/kubelet/plugins/gpu.nvidia.com" in host_paths(ds)
    assert "/data/kubelet/plugins/gpu.nvidia.com" in mounts(ds)


def test_dra_mode_may_write_resourceslices_and_read_claims_and_nodes_only(chart: Any) -> None:
    docs = render(chart, {"mode": "dra"})
    assert rules(docs, "ClusterRole", "kubegpu") == {
        "resourceslices": {"get", "list", "watch", "create", "update", "delete"},
        "resourceclaims": {"get"},
        # Its own Node's status, for device-plugin resources it still shows.
        "nodes": {"get"},
    }
    assert rules(render(chart, values("dra-values.yaml")), "ClusterRole", "kubegpu")["nodes"] == {
        "get",
        "list",
        "watch",
    }  # named configs: the label watch


def test_plugin_mode_is_the_default_and_installs_no_dra_objects(chart: Any) -> None:
    docs = render(chart)
    assert env(one(docs, "DaemonSet", "kubegpu"))["KUBEGPU_MODE"] == "plugin"
    assert not [d for d in docs if d["apiVersion"].startswith("resource.k8s.io/")]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["mode"] == "plugin"


def test_dra_classes_can_leave_out_extended_resource_names_and_serve_amd(chart: Any) -> None:
    base = values("dra-values.yaml")
    plain = render(chart, base | {"dra": {"extendedResourceNames": False}})
    assert "extendedResourceName" not in one(plain, "DeviceClass", "gpu.nvidia.com")["spec"]
    amd = render(chart, {"mode": "dra", "backend": "amd"})
    (only,) = [d for d in amd if d["kind"] == "DeviceClass"]
    assert only["metadata"]["name"] == "gpu.amd.com"
    assert only["spec"]["extendedResourceName"] == "amd.com/gpu"
    for doc in amd:
        if doc["kind"] == "DeviceClass":
            kubernetes_validate.validate(doc, DRA_KUBE_VERSION, strict=True)
    none = render(chart, {"mode": "dra", "dra": {"deviceClasses": False}})
    assert not [d for d in none if d["kind"] == "DeviceClass"]


def test_schema_rejects_an_unknown_mode(chart: Any) -> None:
    for bad in (
        {"mode": "both"},
        {"dra": {"kubeletPluginsDirectoryPath": "relative/path"}},
    ):
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(bad)
    with pytest.raises(helm_python.HelmRenderError, match=r"unknown value 'dra\.x'"):
        render(chart, {"dra": {"x": 1}})


def test_dra_notes_warn_about_cdi_and_the_checkpoint(chart: Any) -> None:
    out = chart.render(
        values("dra-values.yaml"), name="kubegpu", namespace="kube-system", is_install=True
    )
    notes = next(text for name, text in out.items() if name.endswith("NOTES.txt"))
    assert "containerd 1.6" in notes and "checkpoint" in notes
    plain = chart.render({}, name="kubegpu", namespace="kube-system", is_install=True)
    assert "mode=dra" not in next(t for n, t in plain.items() if n.endswith("NOTES.txt"))


# --- mode: dra, the ResourceSlice admission policy --------------------------------------------

PLUGIN_USER = "system:serviceaccount:kube-system:kubegpu"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


def slice_policy(docs: list[Doc]) -> Doc:
    policy = one(docs, "ValidatingAdmissionPolicy", "kubegpu-resourceslices")
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "kubegpu-resourceslices")
    assert binding["spec"] == {
        "policyName": "kubegpu-resourceslices",
        "validationActions": ["Deny"],
    }
    return policy


def test_dra_mode_installs_the_slice_policy_for_resourceslice_writes_only(chart: Any) -> None:
    docs = render(chart, values("dra-values.yaml"))
    spec = slice_policy(docs)["spec"]
    assert spec["failurePolicy"] == "Fail"
    # Every version of the API, every write the ClusterRole grants.
    assert spec["matchConstraints"] == {
        "matchPolicy": "Equivalent",
        "resourceRules": [
            {
                "apiGroups": ["resource.k8s.io"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE", "DELETE"],
                "resources": ["resourceslices"],
            }
        ],
    }
    granted = rules(docs, "ClusterRole", "kubegpu")["resourceslices"]
    assert {v.upper() for v in granted} - {"GET", "LIST", "WATCH"} == {
        "CREATE",
        "UPDATE",
        "DELETE",
    }
    for doc in docs:
        if doc["apiVersion"].startswith("admissionregistration.k8s.io/"):
            validate(doc)
    for plain in (
        render(chart),
        render(chart, {"mode": "dra", "dra": {"sliceAdmissionPolicy": False}}),
    ):
        assert not [d for d in plain if d["kind"].startswith("ValidatingAdmissionPolicy")]


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    import celpy
    from celpy.evaluation import CELEvalError

    env = celpy.Environment()
    result = env.program(env.compile(expression)).evaluate(activation)
    if isinstance(result, CELEvalError):
        raise result
    return result


def admit(
    policy: Doc,
    operation: str,
    user: str,
    *,
    node: str | None,
    obj: Doc | None = None,
    old: Doc | None = None,
) -> str | None:
    """The policy's verdict on one request, evaluated as the API server does (match
    conditions, then the variables in order, then each validation): None when allowed,
    else the denial's message."""
    from celpy import celtypes
    from celpy.adapter import json_to_cel

    user_info: Doc = {"username": user, "groups": ["system:serviceaccounts"]}
    if node is not None:
        user_info["extra"] = {NODE_NAME_KEY: [node]}
    request = {"operation": operation, "userInfo": user_info}
    activation: dict[str, Any] = {
        "request": json_to_cel(request),
        "object": json_to_cel(obj),
        "oldObject": json_to_cel(old),
    }
    spec = policy["spec"]
    if not all(_cel(c["expression"], activation) for c in spec["matchConditions"]):
        return None
    variables = celtypes.MapType()
    for variable in spec["variables"]:
        value = _cel(variable["expression"], {**activation, "variables": variables})
        variables[celtypes.StringType(variable["name"])] = value
    activation["variables"] = variables
    for check in spec["validations"]:
        if not _cel(check["expression"], activation):
            if "messageExpression" in check:
                return str(_cel(check["messageExpression"], activation))
            return str(check["message"])
    return None


def resource_slice(node: str | None, driver: str = "gpu.nvidia.com") -> Doc:
    spec: Doc = {"driver": driver, "pool": {"name": node or "all", "generation": 1,
                                            "resourceSliceCount": 1}}  # fmt: skip
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-gpu.nvidia.com-x"}, "spec": spec}  # fmt: skip


def test_the_slice_policy_lets_a_nodes_plugin_write_only_its_own_nodes_slices(
    chart: Any,
) -> None:
    policy = slice_policy(render(chart, values("dra-values.yaml")))
    a, b = resource_slice("node-a"), resource_slice("node-b")
    # Its own node's slice: create, update, delete.
    assert admit(policy, "CREATE", PLUGIN_USER, node="node-a", obj=a) is None
    assert admit(policy, "UPDATE", PLUGIN_USER, node="node-a", obj=a, old=a) is None
    assert admit(policy, "DELETE", PLUGIN_USER, node="node-a", old=a) is None
    # Another node's: refused, saying which node the pod is on.
    for operation, obj, old in (("CREATE", b, None), ("UPDATE", b, b), ("DELETE", None, b)):
        denied = admit(policy, operation, PLUGIN_USER, node="node-a", obj=obj, old=old)
        assert denied == (
            "the kubegpu plugin on node node-a may write only the ResourceSlices of that "
            "node (spec.nodeName)"
        ), operation
    # An update that would move a slice between nodes, either way.
    assert admit(policy, "UPDATE", PLUGIN_USER, node="node-a", obj=a, old=b)
    assert admit(policy, "UPDATE", PLUGIN_USER, node="node-a", obj=b, old=a)
    # A slice for no node in particular, or another driver's slice on its own node.
    assert admit(policy, "CREATE", PLUGIN_USER, node="node-a", obj=resource_slice(None))
    other = resource_slice("node-a", driver="gpu.example.com")
    assert "its own driver (gpu.nvidia.com)" in str(
        admit(policy, "CREATE", PLUGIN_USER, node="node-a", obj=other)
    )
    # A token that names no node (the plugin run outside a pod): nothing at all.
    denied = admit(policy, "CREATE", PLUGIN_USER, node=None, obj=a)
    assert denied is not None and "ServiceAccountTokenPodNodeInfo" in denied


def test_the_slice_policy_leaves_other_users_and_drivers_alone(chart: Any) -> None:
    policy = slice_policy(render(chart, values("dra-values.yaml")))
    b = resource_slice("node-b", driver="gpu.example.com")
    for user, node in (
        ("system:node:node-b", None),  # the kubelet, deleting its node's slices
        ("system:serviceaccount:dra:example-driver", "node-a"),  # another driver
        ("system:serviceaccount:kube-system:kubegpu-labeller", "node-a"),
        ("kubernetes-admin", None),
    ):
        assert admit(policy, "CREATE", user, node=node, obj=b) is None, user
        assert admit(policy, "DELETE", user, node=node, old=b) is None, user


def test_the_slice_policy_names_the_release_account_and_the_amd_driver(chart: Any) -> None:
    out = chart.render(
        {"mode": "dra", "backend": "amd"}, name="gpus", namespace="gpu-system", is_install=True
    )
    docs = [d for t, text in out.items() if t.endswith(".yaml") for d in yaml.safe_load_all(text)]
    policy = one([d for d in docs if d], "ValidatingAdmissionPolicy", "gpus-kubegpu-resourceslices")
    user = "system:serviceaccount:gpu-system:gpus-kubegpu"
    amd = resource_slice("node-a", driver="gpu.amd.com")
    assert admit(policy, "CREATE", user, node="node-a", obj=amd) is None
    assert admit(policy, "CREATE", user, node="node-a", obj=resource_slice("node-a"))
    assert admit(policy, "CREATE", user, node="node-a", obj=resource_slice("node-b", "gpu.amd.com"))
    # The default release's account is another user to this release's policy.
    assert admit(policy, "CREATE", PLUGIN_USER, node="node-a", obj=resource_slice("node-b")) is None
