"""NVIDIA's Helm values install unchanged on kubegpu's chart, with NVIDIA's meaning.

The cases are NVIDIA's: its chart's own ``values.yaml`` and the config files its README
passes with ``--set-file`` (both read unmodified from ../shared/peer-data), the
``helm upgrade -i`` examples of its READMEs, and the cases of its ``tests/helm``
(see ``tests/conformance/data/nvidia/helm/README.md``). What each value means was read off
NVIDIA's templates at the same commit (NVIDIA_DP.cite("deployments/helm/nvidia-device-plugin/
templates/...")), named in the docstring where it is asserted. Rendering uses the
real Helm engine; rendered objects are validated against the Kubernetes schemas.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conformance.origin import DATA, NVIDIA_DP, PEER_DATA, needs_peer_data, peer_file

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deployments" / "helm" / "kubegpu"
HELM_DATA = DATA / "nvidia" / "helm"
KUBE_VERSION = "1.33.0"
#: Every install is valid on 1.36 too (kubernetes-validate 1.37.0 ships up to 1.37.0).
NEWER_KUBE_VERSION = "1.36.0"
RELEASE = "nvdp"
NAMESPACE = "nvidia-device-plugin"
CRD_KINDS = {"ServiceMonitor"}
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm_python.Chart.load(str(CHART)) as loaded:
        yield loaded


def nvidia_values() -> dict[str, Any]:
    """NVIDIA's chart values.yaml, unchanged (peer-data)."""
    path = peer_file("nvidia", "chart", "values.yaml")
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


#: The files NVIDIA's README writes with heredocs and passes with `--set-file /tmp/<name>`,
#: and their names in peer-data (README line of the heredoc).
README_CONFIGS = {
    "dp-example-config0.yaml": "readme-l713-config0.yaml",
    "dp-example-config1.yaml": "readme-l768-config1.yaml",
}


def readme_config(name: str) -> Path:
    return peer_file("nvidia", "readme-configs", README_CONFIGS[name])


class Rendered:
    """One render: the manifests as objects, and NOTES.txt."""

    def __init__(self, out: dict[str, str]) -> None:
        self.notes = next((t for name, t in out.items() if name.endswith("NOTES.txt")), "")
        self.docs: list[Doc] = []
        for name, text in sorted(out.items()):
            if name.endswith(".yaml"):
                self.docs.extend(d for d in yaml.safe_load_all(text) if d)

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def daemonset(self, component: str) -> Doc | None:
        found = [
            d
            for d in self.of_kind("DaemonSet")
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
        ]
        assert len(found) <= 1
        return found[0] if found else None

    def plugin(self) -> Doc:
        ds = self.daemonset("device-plugin")
        assert ds is not None, "no device plugin DaemonSet"
        return ds

    def labeller(self) -> Doc:
        ds = self.daemonset("labeller")
        assert ds is not None, "no labeller DaemonSet"
        return ds


def render(chart: Any, vals: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> Rendered:
    vals = vals or {}
    chart.validate_schema(vals)
    return Rendered(chart.render(vals, name=RELEASE, namespace=namespace, is_install=True))


def pod(ds: Doc) -> Doc:
    spec: Doc = ds["spec"]["template"]["spec"]
    return spec


def container(ds: Doc) -> Doc:
    containers = pod(ds)["containers"]
    assert len(containers) == 1
    result: Doc = containers[0]
    return result


def env(ds: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(ds).get("env", [])}


def mounts(ds: Doc) -> dict[str, Doc]:
    return {m["mountPath"]: m for m in container(ds).get("volumeMounts", [])}


def host_paths(ds: Doc) -> set[str]:
    return {v["hostPath"]["path"] for v in pod(ds).get("volumes", []) if "hostPath" in v}


def api_server_accepts(doc: Doc) -> None:
    """Checks the API server makes beyond the OpenAPI schema, for what the chart varies.

    From Kubernetes' ValidateSecurityContext: privileged containers cannot also forbid
    privilege escalation. From the DaemonSet validation: the selector must match the pod
    template's labels.
    """
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    kubernetes_validate.validate(doc, NEWER_KUBE_VERSION, strict=True)
    if doc["kind"] != "DaemonSet":
        return
    for c in pod(doc)["containers"]:
        sc = c.get("securityContext") or {}
        assert not (sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False), sc
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()


def assert_all_valid(r: Rendered) -> None:
    for doc in r.docs:
        if doc["kind"] in CRD_KINDS:
            continue
        api_server_accepts(doc)


def assert_grants_as_nvidia(ours: Doc, nvidia: Doc) -> None:
    """kubegpu grants exactly what NVIDIA's chart grants, and restricts at least as much."""
    assert bool(ours.get("privileged")) == bool(nvidia.get("privileged")), ours
    theirs_caps = nvidia.get("capabilities", {})
    our_caps = ours.get("capabilities", {})
    assert set(our_caps.get("add", [])) == set(theirs_caps.get("add", [])), ours
    if nvidia.get("allowPrivilegeEscalation") is False:
        assert ours["allowPrivilegeEscalation"] is False
    if "ALL" in theirs_caps.get("drop", []):
        assert "ALL" in our_caps["drop"]


# --- NVIDIA's values.yaml, unchanged ----------------------------------------------------


def test_nvidia_values_yaml_passes_the_schema_and_renders_valid_objects(chart: Any) -> None:
    """NVIDIA values.yaml: a copied values file installs as is."""
    r = render(chart, nvidia_values())
    assert_all_valid(r)
    ds = r.plugin()
    assert ds["metadata"]["namespace"] == NAMESPACE
    assert r.daemonset("labeller") is None  # gfd.enabled: false


def test_nvidia_values_yaml_with_every_component_on_renders_valid_objects(chart: Any) -> None:
    """The values NVIDIA's README sets on top of it (gfd, MIG, CPU manager) stay valid too.

    NVIDIA's own gfd.securityContext {privileged: true} is used as given: kubegpu's
    defaults must not be merged into it (privileged with allowPrivilegeEscalation false is
    refused by the API server).
    """
    vals = nvidia_values()
    vals["gfd"]["enabled"] = True
    vals["migStrategy"] = "mixed"
    r = render(chart, vals)
    assert_all_valid(r)
    assert container(r.labeller())["securityContext"] == {"privileged": True}


def test_helm_lint_strict_is_clean_with_nvidia_values() -> None:
    report = helm_python.lint(
        str(CHART),
        nvidia_values(),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def _leaf_paths(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaf_paths(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def _nvidia_value_paths() -> list[Any]:
    """One case per leaf of NVIDIA's values.yaml; one skipped case where peer-data is absent."""
    if not PEER_DATA.is_dir():
        return [pytest.param("", marks=needs_peer_data, id="values.yaml")]
    return [p for p, _ in _leaf_paths(nvidia_values())]


@pytest.mark.parametrize("path", _nvidia_value_paths())
def test_every_nvidia_value_is_accepted_alone(chart: Any, path: str) -> None:
    """Each key of NVIDIA's values.yaml, set on its own to NVIDIA's default, renders."""
    value = dict(_leaf_paths(nvidia_values()))[path]
    vals: dict[str, Any] = {}
    node = vals
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    assert_all_valid(render(chart, vals))


@pytest.mark.deliberate("helm-nvidia-image-replaced")
def test_nvidia_image_is_replaced_by_kubegpus_and_notes_say_so(chart: Any) -> None:
    """NVIDIA's values name nvcr.io/nvidia/k8s-device-plugin, which has no kubegpu in it."""
    r = render(chart, nvidia_values())
    image = container(r.plugin())["image"]
    assert image.startswith("ghcr.io/kubegpu/kubegpu:")
    assert "nvcr.io/nvidia/k8s-device-plugin is NVIDIA's image" in r.notes
    mirrored = render(chart, {"image": {"repository": "registry.local/nvidia/k8s-device-plugin"}})
    assert container(mirrored.plugin())["image"].startswith("ghcr.io/kubegpu/kubegpu:")
    own = render(chart, {"image": {"repository": "registry.local/kubegpu", "tag": "1.2"}})
    assert container(own.plugin())["image"] == "registry.local/kubegpu:1.2"
    assert "NVIDIA's image" not in own.notes


@pytest.mark.deliberate("helm-no-nfd-subchart")
def test_nfd_values_are_accepted_and_notes_name_them(chart: Any) -> None:
    """NVIDIA's chart deploys NFD as a subchart (nfd.*); kubegpu deploys no NFD and says so."""
    r = render(chart, _merge(nvidia_values(), {"gfd": {"enabled": True}}))
    assert not [d for d in r.docs if "node-feature-discovery" in d["metadata"]["name"]]
    notes = [line.strip() for line in r.notes.splitlines()]
    assert any(line.startswith("nfd.*:") and "gfd.nodePatch" in line for line in notes)
    assert any(line.startswith("gfd.nameOverride:") for line in notes)
    assert not any(line.startswith("cdi.featureFlags") for line in notes)
    plain = render(chart, {"gfd": {"enabled": True}})
    assert "nfd.*" not in plain.notes and "does not act on" not in plain.notes
    flags = render(chart, {"cdi": {"featureFlags": "disable-gsp"}})
    assert "cdi.featureFlags:" in flags.notes


# --- NVIDIA's tests/helm cases -----------------------------------------------------------

TEMPLATE_CASES = yaml.safe_load((HELM_DATA / "template-cases.yaml").read_text())


@pytest.mark.parametrize(
    "case",
    TEMPLATE_CASES,
    ids=[
        f"{NVIDIA_DP.cite('tests/helm/helm_template_test.go')} {c['description']}"
        for c in TEMPLATE_CASES
    ],
)
def test_nvidia_template_case(chart: Any, case: dict[str, Any]) -> None:
    vals: dict[str, Any] = {}
    for key, text in case["options"].items():
        vals = _merge(vals, helm_python.parse_set_string(f"{key}={text}"))
    namespace = f"k8s-device-plugin-test-{TEMPLATE_CASES.index(case)}"
    r = render(chart, vals, namespace=namespace)
    ds = r.plugin()
    assert ds["metadata"]["namespace"] == namespace
    assert_grants_as_nvidia(container(ds)["securityContext"], case["securityContext"])


# --- README examples ---------------------------------------------------------------------

EXAMPLES = yaml.safe_load((HELM_DATA / "readme-examples.yaml").read_text())
#: Examples whose NVIDIA fact kubegpu differs from on purpose -> (fact, difference id).
DELIBERATE = {"single-config-file": ("plugin_security", "helm-sys-admin-only-when-needed")}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def values_from_args(args: list[str]) -> tuple[dict[str, Any], str]:
    """The values and namespace of a `helm upgrade -i` command line, as Helm builds them."""
    vals: dict[str, Any] = {}
    namespace = "default"
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--set", "--set-file", "--namespace", "--version"):
            option, text = arg, args[i + 1]
            i += 2
        elif "=" in arg:
            option, text = arg.split("=", 1)
            i += 1
        else:
            i += 1  # --create-namespace
            continue
        if option == "--namespace":
            namespace = text
        elif option == "--set":
            vals = _merge(vals, helm_python.parse_set_string(text))
        elif option == "--set-file":
            key, path = text.split("=", 1)
            local = readme_config(Path(path).name)
            vals = _merge(vals, helm_python.parse_set_file(f"{key}={local}"))
    return vals, namespace


def _example_id(example: dict[str, Any]) -> str:
    return f"{example['id']} {NVIDIA_DP.cite(example['source'])}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[_example_id(e) for e in EXAMPLES])
def test_nvidia_readme_example(chart: Any, example: dict[str, Any]) -> None:
    """Each `helm upgrade -i` of NVIDIA's READMEs renders, with the facts NVIDIA's chart has."""
    vals, namespace = values_from_args(example["args"])
    r = render(chart, vals, namespace=namespace)
    assert_all_valid(r)
    facts = example["nvidia"]
    skipped, _ = DELIBERATE.get(example["id"], (None, None))
    components = {"plugin": "device-plugin", "gfd": "labeller"}
    present = [k for k, c in components.items() if r.daemonset(c) is not None]
    assert sorted(present) == sorted(facts["daemonsets"])
    if "plugin_env" in facts:
        plugin_env = env(r.plugin())
        for name, value in facts["plugin_env"].items():
            assert plugin_env.get(name) == value, name
    if "default_config" in facts:
        assert env(r.plugin())["DEFAULT_CONFIG"] == facts["default_config"]
    if "plugin_security" in facts and skipped != "plugin_security":
        assert_grants_as_nvidia(container(r.plugin())["securityContext"], facts["plugin_security"])
    if "plugin_resources" in facts:
        assert container(r.plugin())["resources"] == facts["plugin_resources"]
    if "configmap_keys" in facts:
        maps = r.of_kind("ConfigMap")
        keys = sorted(maps[0]["data"]) if maps else []
        assert keys == sorted(facts["configmap_keys"])
    if "mounted_configmap" in facts:
        volumes = {v["name"]: v for v in pod(r.plugin())["volumes"]}
        assert volumes["available-configs"]["configMap"]["name"] == facts["mounted_configmap"]


@pytest.mark.deliberate("helm-sys-admin-only-when-needed")
def test_embedded_configs_are_read_before_adding_sys_admin(chart: Any) -> None:
    """NVIDIA adds SYS_ADMIN for any config.map (NVIDIA _helpers.tpl: hasConfigMap); kubegpu reads
    the configs and adds it only when one enables MIG or volume-mounts."""
    config0 = readme_config("dp-example-config0.yaml").read_text()
    config1 = readme_config("dp-example-config1.yaml").read_text()
    no_mig = render(chart, {"config": {"map": {"config": config0}}})
    assert "add" not in container(no_mig.plugin())["securityContext"]["capabilities"]
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in env(no_mig.plugin())
    both = {"config0": config0, "config1": config1}
    mig = render(chart, {"config": {"map": both, "default": "config0"}})
    assert container(mig.plugin())["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    mounts_cfg = config0.replace(
        "deviceListStrategy: envvar", "deviceListStrategy: [volume-mounts]"
    )
    vm = render(chart, {"config": {"map": {"config": mounts_cfg}}})
    assert container(vm.plugin())["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]


def test_readme_config_files_are_valid_kubegpu_configs() -> None:
    """The config files NVIDIA's README passes with --set-file load in kubegpu."""
    from kubegpu.config import parse_config

    none = parse_config(readme_config("dp-example-config0.yaml").read_text())
    mixed = parse_config(readme_config("dp-example-config1.yaml").read_text())
    assert none.flags.mig_strategy.value == "none"
    assert mixed.flags.mig_strategy.value == "mixed"
    assert none.flags.fail_on_init_error is True


# --- what each NVIDIA key means -----------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "var"),
    [
        ("gdsEnabled", "GDS_ENABLED"),
        ("mofedEnabled", "MOFED_ENABLED"),
        ("gdrcopyEnabled", "GDRCOPY_ENABLED"),
    ],
)
def test_gds_mofed_gdrcopy_become_nvidias_env_vars(chart: Any, key: str, var: str) -> None:
    """NVIDIA daemonset-device-plugin.yml: a bool value is rendered quoted; null renders nothing."""
    assert env(render(chart, {key: True}).plugin())[var] == "true"
    assert env(render(chart, {key: False}).plugin())[var] == "false"
    assert var not in env(render(chart, {key: None}).plugin())
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema({key: "yes please"})


def test_dev_root_and_cdi_hook_path(chart: Any) -> None:
    """nvidiaDevRoot -> NVIDIA_DEV_ROOT; cdi.nvidiaHookPath -> the hook path flag (NVIDIA's
    binary reads it as NVIDIA_CDI_HOOK_PATH or NVIDIA_CTK_PATH; kubegpu as the latter)."""
    e = env(render(chart, {"nvidiaDevRoot": "/run/nvidia/dev"}).plugin())
    assert e["NVIDIA_DEV_ROOT"] == "/run/nvidia/dev"
    hook = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    e = env(render(chart, {"cdi": {"nvidiaHookPath": hook}}).plugin())
    assert e["NVIDIA_CTK_PATH"] == hook
    both = render(chart, {"cdi": {"nvidiaHookPath": hook}, "nvidiaCTKPath": "/x/nvidia-ctk"})
    assert env(both.plugin())["NVIDIA_CTK_PATH"] == "/x/nvidia-ctk"


def test_driver_root_is_mounted_only_when_it_names_one(chart: Any) -> None:
    """As NVIDIA's chart: the driver root is mounted at /driver-root (type Directory) when
    nvidiaDriverRoot is set; the host's `/` is never mounted for the plugin without CDI."""
    r = render(chart, {"nvidiaDriverRoot": "/run/nvidia/driver", "gfd": {"enabled": True}})
    for ds in (r.plugin(), r.labeller()):
        volume = next(v for v in pod(ds)["volumes"] if v["name"] == "driver-root")
        assert volume["hostPath"] == {"path": "/run/nvidia/driver", "type": "Directory"}
        assert mounts(ds)["/driver-root"]["readOnly"] is True
        assert env(ds)["CONTAINER_DRIVER_ROOT"] == "/driver-root"
    for root in (None, "/"):
        r = render(chart, {"nvidiaDriverRoot": root, "gfd": {"enabled": True}})
        for ds in (r.plugin(), r.labeller()):
            assert "/" not in host_paths(ds) and "/driver-root" not in mounts(ds)
    cdi = render(chart, {"deviceListStrategy": "cdi-cri"})
    assert "/" in host_paths(cdi.plugin())  # the CDI spec lists the host's driver files


@pytest.mark.deliberate("helm-mounts-only-when-needed")
def test_nvidia_values_mount_only_what_is_used(chart: Any) -> None:
    """NVIDIA's plugin pod always mounts /var/run/cdi and the MPS dirs (NVIDIA
    daemonset-device-plugin.yml); kubegpu's only when CDI or MPS is on. With metrics on (the
    default) it reads, read-only, what attributes GPU use to containers: the host's process
    cgroups and the kubelet's PodResources socket."""
    ds = render(chart, nvidia_values()).plugin()
    assert host_paths(ds) == {
        "/var/lib/kubelet/device-plugins",
        "/proc",
        "/var/lib/kubelet/pod-resources",
    }
    assert mounts(ds)["/host/proc"].get("readOnly") is True
    assert mounts(ds)["/var/lib/kubelet/pod-resources"].get("readOnly") is True
    off = render(chart, {**nvidia_values(), "metrics": {"enabled": False}}).plugin()
    assert host_paths(off) == {"/var/lib/kubelet/device-plugins"}


@pytest.mark.parametrize(
    ("vals", "component"),
    [
        ({"devicePlugin": {"enableHostNetwork": True}}, "device-plugin"),
        ({"gfd": {"enabled": True, "enableHostNetwork": True}}, "labeller"),
        ({"mps": {"enabled": True, "enableHostNetwork": True}}, "device-plugin"),
    ],
)
def test_enable_host_network(chart: Any, vals: dict[str, Any], component: str) -> None:
    """NVIDIA daemonset-device-plugin.yml: hostNetwork with dnsPolicy ClusterFirstWithHostNet."""
    r = render(chart, vals)
    ds = r.daemonset(component)
    assert ds is not None
    assert pod(ds)["hostNetwork"] is True
    assert pod(ds)["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in pod(render(chart).plugin())


def test_mps_enable_host_pid_applies_where_the_mps_daemons_run(chart: Any) -> None:
    """NVIDIA's MPS control daemon pod gets hostPID (default true); kubegpu's plugin runs the
    daemons, so its pod gets it while MPS is on, and never otherwise."""
    assert pod(render(chart, {"mps": {"enabled": True}}).plugin())["hostPID"] is True
    off = render(chart, {"mps": {"enabled": True, "enableHostPID": False}})
    assert "hostPID" not in pod(off.plugin())
    assert "hostPID" not in pod(render(chart, nvidia_values()).plugin())


@pytest.mark.deliberate("helm-selector-keeps-component")
def test_selector_labels_override(chart: Any) -> None:
    """NVIDIA _helpers.tpl: the override replaces the selector's name/instance and is added to
    the pod labels. kubegpu keeps its component label in the selector, so the plugin's and
    the labeller's DaemonSets never select each other's pods."""
    override = {"name": "nvidia-device-plugin-ds"}
    r = render(chart, {"selectorLabelsOverride": override, "gfd": {"enabled": True}})
    for ds in (r.plugin(), r.labeller()):
        selector = ds["spec"]["selector"]["matchLabels"]
        assert selector["name"] == "nvidia-device-plugin-ds"
        assert "app.kubernetes.io/name" not in selector
        assert "app.kubernetes.io/component" in selector
        assert ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    service = r.of_kind("Service")[0]
    assert service["spec"]["selector"] == r.plugin()["spec"]["selector"]["matchLabels"]
    assert_all_valid(r)


def test_default_namespace_is_refused_unless_allowed(chart: Any) -> None:
    """NVIDIA validation.yml: a release in the 'default' namespace fails unless
    allowDefaultNamespace, whatever namespaceOverride says; namespaceOverride=default from
    another release namespace passes both of its checks."""
    with pytest.raises(helm_python.HelmError, match="allowDefaultNamespace=true"):
        chart.render({}, name=RELEASE, namespace="default", is_install=True)
    with pytest.raises(helm_python.HelmError, match="allowDefaultNamespace=true"):
        chart.render({"namespaceOverride": "gpu"}, name=RELEASE, namespace="default")
    assert render(chart, {"namespaceOverride": "default"}, namespace="gpu").plugin()
    r = render(chart, {"allowDefaultNamespace": True}, namespace="default")
    assert r.plugin()["metadata"]["namespace"] == "default"


@pytest.mark.parametrize(
    ("vals", "message"),
    [
        ({"namespace": "gpu"}, "--namespace"),
        ({"config": {"name": "a", "map": {"b": "version: v1\n"}}}, "only one of config.name"),
        ({"config": {"map": {"a": "version: v1\n", "b": "version: v1\n"}}}, "config.default"),
        (
            {"config": {"map": {"a": "version: v1\n"}, "fallbackStrategies": ["named"]}},
            "config.default",
        ),
    ],
)
def test_values_nvidia_refuses_are_refused(chart: Any, vals: dict[str, Any], message: str) -> None:
    """NVIDIA validation.yml: each of these fails NVIDIA's install; the message says what to do."""
    with pytest.raises(helm_python.HelmError, match=message) as failure:
        chart.render(vals, name=RELEASE, namespace=NAMESPACE, is_install=True)
    reason = str(failure.value).rsplit("fail:", 1)[-1].strip()
    assert "\n" not in reason


@pytest.mark.parametrize(
    ("config", "default"),
    [
        ({"map": {"default": "version: v1\n", "b": "version: v1\n"}}, "default"),
        ({"map": {"a": "version: v1\n"}}, "a"),
        (
            {
                "map": {"a": "version: v1\n", "b": "version: v1\n"},
                "fallbackStrategies": ["named", "single", "empty"],
            },
            None,
        ),
    ],
)
def test_fallback_strategies_including_empty(
    chart: Any, config: dict[str, Any], default: str | None
) -> None:
    """NVIDIA _helpers.tpl hasDefaultConfig: named finds "default", single the only config, and
    empty lets a node run with no config at all."""
    e = env(render(chart, {"config": config}).plugin())
    assert e.get("DEFAULT_CONFIG") == default
    if "fallbackStrategies" in config:
        assert e["FALLBACK_STRATEGIES"] == "named,single,empty"


def test_top_level_gfd_keys_reach_the_labeller(chart: Any) -> None:
    """NVIDIA daemonset-gfd.yml: GFD reads the top-level noTimestamp, sleepInterval and
    nodeSelector."""
    vals = {
        "gfd": {"enabled": True},
        "noTimestamp": True,
        "sleepInterval": "90s",
        "nodeSelector": {"gpu": "yes"},
    }
    r = render(chart, vals)
    e = env(r.labeller())
    assert e["GFD_NO_TIMESTAMP"] == "true" and e["GFD_SLEEP_INTERVAL"] == "90s"
    assert pod(r.labeller())["nodeSelector"] == {"gpu": "yes"}
    assert pod(r.plugin())["nodeSelector"] == {"gpu": "yes"}
    # kubegpu's own gfd.* keys win where both are set.
    vals["gfd"] = {"enabled": True, "sleepInterval": "5m", "nodeSelector": {"zone": "a"}}
    r = render(chart, vals)
    assert env(r.labeller())["GFD_SLEEP_INTERVAL"] == "5m"
    assert pod(r.labeller())["nodeSelector"] == {"gpu": "yes", "zone": "a"}


@pytest.mark.deliberate("helm-labeller-every-node")
def test_labeller_does_not_take_the_plugins_gpu_affinity(chart: Any) -> None:
    """NVIDIA's GFD pod takes the top-level affinity (NVIDIA daemonset-gfd.yml); kubegpu's
    labeller runs on every node, so it can set nvidia.com/gpu.present that this affinity
    looks for."""
    r = render(chart, _merge(nvidia_values(), {"gfd": {"enabled": True}}))
    assert "affinity" in pod(r.plugin())
    assert "affinity" not in pod(r.labeller())


def test_security_context_precedence_is_nvidias(chart: Any) -> None:
    """NVIDIA _helpers.tpl: a non-empty securityContext is used as given (even over
    compatWithCPUManager); SYS_ADMIN is added for an external config that may enable MIG."""
    given = {"runAsUser": 0, "capabilities": {"drop": ["ALL"]}}
    r = render(chart, {"securityContext": given, "compatWithCPUManager": True})
    assert container(r.plugin())["securityContext"] == given
    external = render(chart, {"config": {"name": "my-configs"}})
    assert container(external.plugin())["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    assert env(external.plugin())["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    pinned = render(
        chart,
        {"config": {"name": "my-configs"}, "migStrategy": "none", "deviceListStrategy": "envvar"},
    )
    assert "add" not in container(pinned.plugin())["securityContext"]["capabilities"]


def test_comma_separated_device_list_strategy(chart: Any) -> None:
    """NVIDIA renders a string deviceListStrategy as DEVICE_LIST_STRATEGY, which its binary
    splits on commas."""
    e = env(render(chart, {"deviceListStrategy": "envvar,cdi-cri"}).plugin())
    assert e["DEVICE_LIST_STRATEGY"] == "envvar,cdi-cri"
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema({"deviceListStrategy": "envvar,carrier-pigeon"})


@pytest.mark.deliberate("labeller-fail-on-init-error")
def test_top_level_fail_on_init_error_is_the_plugins_only(chart: Any) -> None:
    """NVIDIA's GFD takes the top-level failOnInitError (NVIDIA daemonset-gfd.yml); kubegpu's
    labeller runs on CPU nodes too, so it takes gfd.failOnInitError (default false)."""
    r = render(chart, {"failOnInitError": True, "gfd": {"enabled": True}})
    assert env(r.plugin())["FAIL_ON_INIT_ERROR"] == "true"
    assert env(r.labeller())["FAIL_ON_INIT_ERROR"] == "false"
    r = render(chart, {"gfd": {"enabled": True, "failOnInitError": True}})
    assert env(r.labeller())["FAIL_ON_INIT_ERROR"] == "true"


# --- GFD's DaemonSet: named configs, downward API, sleepInterval, RBAC ---------------------

GFD = yaml.safe_load((HELM_DATA / "gfd-daemonset.yaml").read_text())
GFD_TEMPLATE = "deployments/helm/nvidia-device-plugin/templates/daemonset-gfd.yml"


def test_labeller_gets_gfds_downward_api_env(chart: Any) -> None:
    """NVIDIA daemonset-gfd.yml: GFD learns its node, namespace and pod (the NodeFeature
    object's owner) from the downward API, under these names."""
    for delivery in ({}, {"useNodeFeatureAPI": True}, {"nodePatch": True}):
        e = env(render(chart, {"gfd": {"enabled": True, **delivery}}).labeller())
        for name, field in GFD["downward_env"].items():
            assert e[name] == {"fieldRef": {"fieldPath": field}}, name


@pytest.mark.parametrize(
    "case",
    GFD["named_config_cases"],
    ids=[f"{c['id']} {NVIDIA_DP.cite(GFD_TEMPLATE)}" for c in GFD["named_config_cases"]],
)
def test_labeller_picks_the_named_config_as_gfds_config_manager(
    chart: Any, case: dict[str, Any]
) -> None:
    """NVIDIA's config-manager picks GFD's config from the node label with these settings;
    kubegpu's labeller reads the same settings itself (no sidecar) from the same ConfigMap."""
    from kubegpu.labeller import named_configs

    # What `kubegpu labels` uses for a setting the chart leaves to the binary (null values).
    binary = named_configs({"config_dir": "/available-configs"}, None)
    assert binary is not None
    defaults = {
        "NODE_LABEL": binary.label,
        "FALLBACK_STRATEGIES": ",".join(binary.fallback_strategies),
    }
    r = render(chart, _merge(case["values"], {"gfd": {"enabled": True}}))
    labeller = r.labeller()
    e = env(labeller)
    for name, value in case["env"].items():
        assert e.get(name, defaults.get(name)) == value, name
    assert mounts(labeller)["/available-configs"]["readOnly"] is True
    volume = next(v for v in pod(labeller)["volumes"] if v["name"] == "available-configs")
    maps = r.of_kind("ConfigMap")
    expected = case.get("configmap") or maps[0]["metadata"]["name"]
    assert volume["configMap"]["name"] == expected
    assert "CONFIG_FILE" not in e  # no fixed file: the node label decides
    assert_all_valid(r)


SLEEP_CASES = GFD["sleep_intervals"]


@pytest.mark.parametrize(
    "case",
    [c for c in SLEEP_CASES if c["ns"] is not None],
    ids=[
        f"{c['value']!r} {NVIDIA_DP.cite(GFD_TEMPLATE)}" for c in SLEEP_CASES if c["ns"] is not None
    ],
)
def test_sleep_interval_means_what_gfd_sleeps(chart: Any, case: dict[str, Any]) -> None:
    """NVIDIA's chart passes sleepInterval on to GFD_SLEEP_INTERVAL; the duration kubegpu's
    labeller gets is the one GFD sleeps, and `kubegpu labels` reads it so."""
    from kubegpu.config.names import parse_go_duration
    from kubegpu.labeller import parse_duration

    for vals in (
        {"gfd": {"enabled": True}, "sleepInterval": case["value"]},
        {"gfd": {"enabled": True, "sleepInterval": case["value"]}},
    ):
        given = env(render(chart, vals).labeller())["GFD_SLEEP_INTERVAL"]
        assert parse_go_duration(given) == case["ns"]
        seconds = parse_duration(given)
        if case["value"] == "infinite":
            assert seconds == float("inf")
        else:
            assert seconds * 1e9 == pytest.approx(case["ns"])


@pytest.mark.deliberate("helm-sleep-interval-nanoseconds")
def test_integer_sleep_interval_is_nanoseconds(chart: Any) -> None:
    """NVIDIA's chart passes an integer sleepInterval on as a bare number, which GFD refuses
    (Go durations need a unit); kubegpu reads it as nanoseconds, as a config file's."""
    from kubegpu.labeller import parse_duration

    for case in (c for c in SLEEP_CASES if c["ns"] is None):
        assert isinstance(case["value"], int)
        chart.validate_schema({"sleepInterval": case["value"]})
        given = env(
            render(chart, {"gfd": {"enabled": True}, "sleepInterval": case["value"]}).labeller()
        )["GFD_SLEEP_INTERVAL"]
        assert given != case["env"]
        assert parse_duration(given) * 1e9 == pytest.approx(case["value"])


def _rules(doc: Doc) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.deliberate("helm-labeller-rbac-by-use")
@pytest.mark.parametrize("named", [False, True], ids=["no-configs", "named-configs"])
@pytest.mark.parametrize("nfd_api", [False, True], ids=["features-file", "nodefeature-api"])
def test_labeller_rbac_is_within_gfds(chart: Any, named: bool, nfd_api: bool) -> None:
    """NVIDIA role.yml grants GFD's account nodes, NodeFeatures and pods whatever it uses;
    kubegpu's labeller gets a subset: nodes to follow named configs, NodeFeatures and its
    namespace's pods for the NodeFeature API, nothing for a features.d file."""
    nvidia = {(r["apiGroup"], r["resource"], verb) for r in GFD["rbac"] for verb in r["verbs"]}
    vals: dict[str, Any] = {"gfd": {"enabled": True, "useNodeFeatureAPI": nfd_api}}
    if named:
        vals["config"] = {"name": "site-configs", "default": "base"}
    r = render(chart, vals)
    granted: set[tuple[str, str, str]] = set()
    for kind in ("ClusterRole", "Role"):
        for doc in r.of_kind(kind):
            if doc["metadata"]["name"].endswith("-labeller"):
                granted |= _rules(doc)
    assert granted <= nvidia
    assert (("", "nodes", "watch") in granted) == named
    assert (("", "pods", "get") in granted) == nfd_api
    assert (("nfd.k8s-sigs.io", "nodefeatures", "create") in granted) == nfd_api
    assert pod(r.labeller())["automountServiceAccountToken"] is bool(named or nfd_api)


@pytest.mark.deliberate("helm-plugin-rbac-node-events")
@pytest.mark.parametrize("named", [False, True], ids=["no-configs", "named-configs"])
def test_plugin_rbac_is_nvidias_plus_node_events_in_default(chart: Any, named: bool) -> None:
    """NVIDIA role.yml gives the device plugin's account nodes get/list/watch only with a
    config map; kubegpu's plugin gets the same cluster-wide, and besides only `create` on
    core Events in `default`, where its Node events go (NVIDIA's plugin records none)."""
    facts = GFD["plugin_rbac"]["with_config_map" if named else "without_config_map"]
    nvidia = {(r["apiGroup"], r["resource"], verb) for r in facts for verb in r["verbs"]}
    vals: dict[str, Any] = {"config": {"name": "site-configs", "default": "base"}} if named else {}
    r = render(chart, vals)
    cluster: set[tuple[str, str, str]] = set()
    for doc in r.of_kind("ClusterRole"):
        if not doc["metadata"]["name"].endswith("-labeller"):
            cluster |= _rules(doc)
    assert cluster == nvidia
    (events,) = r.of_kind("Role")
    assert events["metadata"]["namespace"] == "default"
    assert _rules(events) == {("", "events", "create")}
