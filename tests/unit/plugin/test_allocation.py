"""The Allocate answer: validation, device list strategies, device specs."""

from __future__ import annotations

import pytest

from kubegpu.allocation import (
    VOLUME_MOUNT_ROOT,
    ContainerEdits,
    ImexChannel,
    MountSpec,
    build_response,
    cdi_device_name,
    merge,
    select_imex_channels,
    validate_request,
)
from kubegpu.config import Config, parse_config
from kubegpu.errors import AllocationError, PreconditionError
from kubegpu.resources import ResourceSpec, build_resources
from tests.builders import gpu, inventory

INV = inventory(gpu(0), gpu(1), gpu(2, migs=["1g.10gb", "1g.10gb"]))


def spec_for(config: Config, name: str = "nvidia.com/gpu") -> ResourceSpec:
    return next(s for s in build_resources(INV, config) if s.name == name)


def answer(config_text: str, ids: list[str], name: str = "nvidia.com/gpu") -> ContainerEdits:
    config = parse_config(config_text)
    spec = spec_for(config, name)
    return build_response(spec, validate_request(spec, ids), config, response_id="r1")


def test_envvar_uuid_strategy_default() -> None:
    a = answer("version: v1", [INV.gpus[1].uuid, INV.gpus[0].uuid])
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": f"{INV.gpus[1].uuid},{INV.gpus[0].uuid}"}
    assert a.device_specs == () and a.mounts == () and a.cdi_devices == ()


def test_index_strategy() -> None:
    a = answer("version: v1\nflags: {plugin: {deviceIDStrategy: index}}", [INV.gpus[1].uuid])
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "1"


def test_mig_index_strategy_uses_gpu_colon_gi() -> None:
    config = "version: v1\nflags: {migStrategy: mixed, plugin: {deviceIDStrategy: index}}"
    mig = INV.gpus[2].mig_devices[1]
    a = answer(config, [mig.uuid], name="nvidia.com/mig-1g.10gb")
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "2:2"


def test_pass_device_specs_lists_control_nodes_then_gpu() -> None:
    # NVIDIA's order (internal/rm/nvml_manager.go GetDevicePaths): control nodes first.
    a = answer("version: v1\nflags: {plugin: {passDeviceSpecs: true}}", [INV.gpus[1].uuid])
    assert [d.container_path for d in a.device_specs] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia1",
    ]
    assert all(d.permissions == "rw" and d.host_path == d.container_path for d in a.device_specs)


def test_device_specs_host_paths_under_dev_root() -> None:
    text = (
        "version: v1\nflags: {nvidiaDevRoot: /run/nvidia/driver, plugin: {passDeviceSpecs: true}}"
    )
    a = answer(text, [INV.gpus[0].uuid])
    assert a.device_specs[-1].host_path == "/run/nvidia/driver/dev/nvidia0"
    assert a.device_specs[-1].container_path == "/dev/nvidia0"


def test_mig_device_specs_include_caps() -> None:
    config = "version: v1\nflags: {migStrategy: mixed, plugin: {passDeviceSpecs: true}}"
    mig = INV.gpus[2].mig_devices[0]
    a = answer(config, [mig.uuid], name="nvidia.com/mig-1g.10gb")
    paths = [d.container_path for d in a.device_specs]
    assert "/dev/nvidia2" in paths and "/dev/nvidia-caps/nvidia-cap100" in paths


def test_volume_mounts_strategy() -> None:
    a = answer(
        "version: v1\nflags: {plugin: {deviceListStrategy: volume-mounts}}", [INV.gpus[0].uuid]
    )
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == VOLUME_MOUNT_ROOT
    assert a.mounts == (MountSpec(f"{VOLUME_MOUNT_ROOT}/{INV.gpus[0].uuid}", "/dev/null"),)


def test_cdi_strategies_combined() -> None:
    text = "version: v1\nflags: {plugin: {deviceListStrategy: [envvar, cdi-annotations, cdi-cri]}}"
    a = answer(text, [INV.gpus[0].uuid])
    name = cdi_device_name(INV.gpus[0].uuid)
    assert name == f"k8s.device-plugin.nvidia.com/gpu={INV.gpus[0].uuid}"
    assert a.cdi_devices == (name,)
    assert a.annotations == {"cdi.k8s.io/nvidia-device-plugin_r1": name}
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == INV.gpus[0].uuid


def test_cdi_only_sends_no_visible_devices_env() -> None:
    # As NVIDIA's plugin: CDI-only answers carry no env list, mounts or device nodes.
    text = "version: v1\nflags: {plugin: {deviceListStrategy: cdi-cri, passDeviceSpecs: true}}"
    a = answer(text, [INV.gpus[0].uuid])
    assert a.envs == {} and a.device_specs == () and a.mounts == ()
    assert a.cdi_devices == (cdi_device_name(INV.gpus[0].uuid),)


def test_gds_mofed_gdrcopy_envs() -> None:
    text = "version: v1\nflags: {gdsEnabled: true, mofedEnabled: true, gdrcopyEnabled: true}"
    a = answer(text, [INV.gpus[0].uuid])
    assert a.envs["NVIDIA_GDS"] == a.envs["NVIDIA_MOFED"] == a.envs["NVIDIA_GDRCOPY"] == "enabled"


SHARED = """
version: v1
sharing:
  timeSlicing:
    failRequestsGreaterThanOne: {fail}
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def test_replicas_map_back_to_unique_gpus() -> None:
    u0, u1 = INV.gpus[0].uuid, INV.gpus[1].uuid
    a = answer(SHARED.format(fail="false"), [f"{u0}::0", f"{u0}::3", f"{u1}::1"])
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == f"{u0},{u1}"


def test_fail_requests_greater_than_one() -> None:
    u0 = INV.gpus[0].uuid
    with pytest.raises(AllocationError, match=r"too large.*request 1"):
        answer(SHARED.format(fail="true"), [f"{u0}::0", f"{u0}::1"])
    assert answer(SHARED.format(fail="true"), [f"{u0}::2"]).envs


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "lists no device IDs"),
        (["GPU-nope"], "unknown device ID.*'GPU-nope'"),
        (["GPU-00000000-0000-0000-0000-000000000000::0"], "unknown device ID"),
    ],
)
def test_bad_requests_name_the_problem(ids: list[str], message: str) -> None:
    spec = spec_for(Config())
    with pytest.raises(AllocationError, match=message):
        validate_request(spec, ids)


def test_duplicate_ids_are_answered_once() -> None:
    u0, u1 = INV.gpus[0].uuid, INV.gpus[1].uuid
    a = answer("version: v1", [u0, u1, u0])
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == f"{u0},{u1}"


def test_unknown_ids_are_echoed_bounded_and_escaped() -> None:
    spec = spec_for(Config())
    forged = "GPU-x\nINFO forged log line"
    ids = [forged, "A" * 100_000, *[f"GPU-bad-{n}" for n in range(1000)]]
    with pytest.raises(AllocationError) as info:
        validate_request(spec, ids)
    text = str(info.value)
    assert "\n" not in text and "GPU-x\\nINFO forged" in text
    assert "and 997 more" in text and len(text) < 1000


def test_merge_first_value_wins() -> None:
    a = ContainerEdits(envs={"A": "1"}, mounts=(MountSpec("/x", "/h1"),))
    b = ContainerEdits(
        envs={"A": "2", "B": "3"}, mounts=(MountSpec("/x", "/h2"), MountSpec("/y", "/h3"))
    )
    m = merge(a, b)
    assert m.envs == {"A": "1", "B": "3"}
    assert [mm.host_path for mm in m.mounts] == ["/h1", "/h3"]


def test_amd_always_gets_device_nodes() -> None:
    import dataclasses

    from kubegpu.devices import Vendor

    g = dataclasses.replace(
        gpu(0), vendor=Vendor.AMD, uuid="AMD-1", device_paths=("/dev/dri/renderD128",)
    )
    inv = dataclasses.replace(inventory(g), control_device_paths=("/dev/kfd",))
    config = parse_config("version: v1")
    (spec,) = build_resources(inv, config)
    a = build_response(spec, validate_request(spec, ["AMD-1"]), config, response_id="r")
    assert a.envs == {"AMD_VISIBLE_DEVICES": "AMD-1"}
    assert [d.container_path for d in a.device_specs] == ["/dev/dri/renderD128", "/dev/kfd"]


# -- IMEX channels (NVIDIA internal/plugin/server.go; the cases with NVIDIA's answers are in
# tests/conformance/data/nvidia/config/imex.yaml and plugin/allocate.yaml) --------------------

CDI_BOTH = "version: v1\nflags: {plugin: {deviceListStrategy: [cdi-annotations, cdi-cri]}}"


def imex_answer(config_text: str, cdi_classes: frozenset[str] | None) -> ContainerEdits:
    config = parse_config(config_text)
    spec = spec_for(config)
    devices = validate_request(spec, [INV.gpus[0].uuid])
    return build_response(
        spec,
        devices,
        config,
        response_id="r1",
        imex_channels=[ImexChannel("0")],
        cdi_classes=cdi_classes,
    )


def test_imex_channel_is_named_in_the_cdi_annotation_and_cri_list() -> None:
    a = imex_answer(CDI_BOTH, frozenset({"gpu", "imex-channel"}))
    names = (cdi_device_name(INV.gpus[0].uuid), "k8s.device-plugin.nvidia.com/imex-channel=0")
    assert a.annotations == {"cdi.k8s.io/nvidia-device-plugin_r1": ",".join(names)}
    assert a.cdi_devices == names
    assert a.envs == {}, "CDI only: no NVIDIA_IMEX_CHANNELS, the runtime injects the channel"


def test_imex_channel_without_a_cdi_spec_is_not_named() -> None:
    """A CDI name with no spec on the node fails the container: the channel is left out
    until the plugin has written `...-imex-channel.json`, the GPUs are still named."""
    a = imex_answer(CDI_BOTH, frozenset({"gpu"}))
    assert a.cdi_devices == (cdi_device_name(INV.gpus[0].uuid),)
    assert "imex-channel" not in a.annotations["cdi.k8s.io/nvidia-device-plugin_r1"]


def test_imex_channel_names_match_the_cdi_spec() -> None:
    """The name Allocate uses is a device of the spec the plugin writes for the channel."""
    from kubegpu import cdi

    spec = cdi.generate_imex_spec([ImexChannel("0")])
    assert spec is not None
    (name,) = [n for n in imex_answer(CDI_BOTH, None).cdi_devices if "imex" in n]
    assert name == f"{spec['kind']}={spec['devices'][0]['name']}"


REQUIRED_UNDER_A_DEV_ROOT = (
    "version: v1\nflags: {nvidiaDevRoot: /run/nvidia/driver}\n"
    "imex: {channelIDs: [0], required: true}\n"
)
CHANNEL_0 = "/dev/nvidia-caps-imex-channels/channel0"


@pytest.mark.parametrize("found", [f"/run/nvidia/driver{CHANNEL_0}", CHANNEL_0])
def test_an_imex_channel_is_found_under_the_dev_root_or_at_its_own_path(found: str) -> None:
    """Where NVIDIA's internal/imex looks: the host's /dev as mounted under the dev root,
    and the path itself (a /dev this container was given)."""
    config = parse_config(REQUIRED_UNDER_A_DEV_ROOT)
    assert select_imex_channels(config, lambda path: path == found) == (ImexChannel("0"),)


def test_a_required_imex_channel_found_nowhere_is_one_line_naming_both_places() -> None:
    config = parse_config(REQUIRED_UNDER_A_DEV_ROOT)
    with pytest.raises(PreconditionError) as caught:
        select_imex_channels(config, lambda path: False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("imex.required: IMEX channel 0")
    assert f"/run/nvidia/driver{CHANNEL_0} or {CHANNEL_0}" in message
    optional = parse_config("version: v1\nimex: {channelIDs: [0]}\n")
    assert select_imex_channels(optional, lambda path: False) == ()


def test_amd_answers_carry_no_imex_channel() -> None:
    """IMEX is NVIDIA's (NVLink fabric memory): an AMD container gets none of it."""
    import dataclasses

    from kubegpu.devices import Vendor

    g = dataclasses.replace(
        gpu(0), vendor=Vendor.AMD, uuid="AMD-1", device_paths=("/dev/dri/renderD128",)
    )
    config = parse_config(CDI_BOTH)
    (spec,) = build_resources(inventory(g), config)
    devices = validate_request(spec, ["AMD-1"])
    a = build_response(
        spec, devices, config, response_id="r", imex_channels=[ImexChannel("0")], cdi_classes=None
    )
    assert a.annotations == {} and a.cdi_devices == ()
    assert "NVIDIA_IMEX_CHANNELS" not in a.envs
    assert all("imex" not in d.container_path for d in a.device_specs)
