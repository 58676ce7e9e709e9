"""The pure part of DRA prepare: a claim's allocation -> devices, CDI spec, answer."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kubegpu import cdi
from kubegpu.config import Config
from kubegpu.config.loader import parse_config
from kubegpu.devices import Vendor
from kubegpu.dra.claims import (
    CLAIM_CDI_KIND,
    ClaimError,
    claim_uid_of,
    node_devices,
    plan_claim,
    spec_file_name,
)
from kubegpu.dra.resourceclaim import parse_claim
from kubegpu.nvidia_paths import MPS_CONTAINER_PIPE_DIR
from kubegpu.resources import build_resources
from tests.builders import gpu, inventory

UID = "0b7c5d2e-1111-4c3e-9a55-000000000001"


def claim(
    *results: tuple[str, str], driver: str = "gpu.nvidia.com", pool: str = "node-a"
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": UID},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": req, "driver": driver, "pool": pool, "device": dev}
                        for req, dev in results
                    ]
                }
            }
        },
    }


def plan(body: dict[str, Any], config: Config | None = None, *, migs: bool = False) -> Any:
    config = config or Config()
    inv = inventory(gpu(0, migs=("1g.10gb",) if migs else ()), gpu(1))
    specs = build_resources(inv, config)
    node_spec = cdi.generate_spec(inv)
    return plan_claim(
        parse_claim(body),
        "gpu.nvidia.com",
        "node-a",
        node_devices("gpu.nvidia.com", specs),
        node_spec,
        config,
    )


def test_devices_are_named_as_nvidia_names_them() -> None:
    inv = inventory(gpu(0), gpu(3))
    names = sorted(node_devices("gpu.nvidia.com", build_resources(inv, Config())))
    assert names == ["gpu-0", "gpu-3"]


def test_time_sliced_replicas_are_one_device() -> None:
    config = parse_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    devices = node_devices("gpu.nvidia.com", build_resources(inventory(gpu(0), gpu(1)), config))
    assert sorted(devices) == ["gpu-0", "gpu-1"]
    assert devices["gpu-1"].shares == 4


def test_a_claim_gets_its_gpu_nodes_and_the_drivers_common_edits() -> None:
    got = plan(claim(("gpu", "gpu-1")))
    assert [d.device for d in got.devices] == ["gpu-1"]
    assert got.devices[0].cdi_ids == (f"{CLAIM_CDI_KIND}={UID}-gpu-1",)
    assert got.devices[0].requests == ("gpu",)
    spec = got.spec
    assert spec["kind"] == CLAIM_CDI_KIND
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-1"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia1"}]
    common = spec["containerEdits"]
    # The same common edits as the device plugin's CDI spec: control nodes, no GPU list.
    assert "NVIDIA_VISIBLE_DEVICES=void" in common["env"]
    assert {"path": "/dev/nvidiactl"} in common["deviceNodes"]
    assert "hooks" not in common


def test_subrequests_answer_under_their_request() -> None:
    got = plan(claim(("gpus/large", "gpu-0"), ("other", "gpu-1")))
    assert [d.requests for d in got.devices] == [("gpus",), ("other",)]


def test_other_drivers_results_are_not_ours() -> None:
    body = claim(("gpu", "gpu-0"))
    body["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "nic.example.com", "pool": "p", "device": "eth0"}
    )
    assert [r.device for r in parse_claim(body).allocation.of("gpu.nvidia.com")] == ["gpu-0"]


def test_a_claim_with_no_device_of_ours_writes_no_spec() -> None:
    got = plan(claim(("nic", "eth0"), driver="nic.example.com"))
    assert got.devices == () and got.spec is None


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"metadata": {"namespace": "ns", "name": "c"}, "status": {}}, "not allocated"),
        (claim(("gpu", "gpu-7")), "'gpu-7' does not exist on this node"),
        (claim(("gpu", "gpu-0"), pool="node-b"), "allocated for another node"),
    ],
)
def test_claims_this_node_cannot_serve_are_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(ClaimError, match=words):
        plan(body)


@pytest.mark.parametrize(
    "status",
    [
        {"allocation": ["gpu-0"]},
        {"allocation": {"devices": {"results": "gpu-0"}}},
        {"allocation": {"devices": {"results": ["gpu-0"]}}},
        {"allocation": {"devices": {"results": [None, {"driver": "gpu.nvidia.com"}]}}},
    ],
)
def test_a_malformed_allocation_is_this_claims_error(status: dict[str, Any]) -> None:
    """A broken API server or a proxy in front of it can send anything: the claim fails
    with a line that says so, and the other claims of the call are prepared."""
    body = {"metadata": ["not", "an", "object"], "status": status}
    with pytest.raises(ClaimError, match="not shaped as the API server writes one"):
        plan(body)


def test_mps_sharing_adds_the_pipe_and_shm_mounts() -> None:
    config = parse_config(
        "version: v1\nflags:\n  mpsRoot: /run/nvidia/mps\nsharing:\n  mps:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n"
    )
    spec = plan(claim(("gpu", "gpu-0")), config).spec
    env = spec["containerEdits"]["env"]
    assert f"CUDA_MPS_PIPE_DIRECTORY={MPS_CONTAINER_PIPE_DIR}" in env
    paths = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert "/dev/shm" in paths


def test_gds_adds_its_env_as_allocate_does() -> None:
    config = parse_config("version: v1\nflags:\n  gdsEnabled: true\n")
    spec = plan(claim(("gpu", "gpu-0")), config).spec
    assert "NVIDIA_GDS=enabled" in spec["containerEdits"]["env"]


def test_a_mig_slice_is_a_device_with_its_parent_and_its_own_nodes() -> None:
    config = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
    inv = inventory(gpu(0, migs=("1g.10gb",)), gpu(1))
    devices = node_devices("gpu.nvidia.com", build_resources(inv, config))
    mig = next(n for n in devices if "mig" in n)
    got = plan(claim(("gpu", mig)), config, migs=True)
    nodes = [n["path"] for n in got.spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap100"]


def test_spec_file_names_round_trip_and_foreign_files_are_not_ours() -> None:
    assert claim_uid_of(spec_file_name(UID)) == UID
    assert claim_uid_of("k8s.device-plugin.nvidia.com-gpu.json") is None
    assert claim_uid_of("k8s.gpu.nvidia.com-claim_x.yaml") is None


def test_an_amd_gpu_gets_its_nodes_once_and_rocms_env() -> None:
    g = dataclasses.replace(
        gpu(0), vendor=Vendor.AMD, uuid="AMD-1", device_paths=("/dev/dri/renderD128",)
    )
    inv = dataclasses.replace(inventory(g), control_device_paths=("/dev/kfd",))
    config = Config()
    devices = node_devices("gpu.amd.com", build_resources(inv, config))
    [name] = devices
    body = claim(("gpu", name), driver="gpu.amd.com")
    got = plan_claim(
        parse_claim(body), "gpu.amd.com", "node-a", devices, cdi.generate_spec(inv), config
    )
    assert got.spec is not None
    [entry] = got.spec["devices"]
    assert entry["containerEdits"]["deviceNodes"] == [{"path": "/dev/dri/renderD128"}]
    common = got.spec["containerEdits"]
    assert common["env"] == ["AMD_VISIBLE_DEVICES=AMD-1"]
    assert [n["path"] for n in common["deviceNodes"]] == ["/dev/kfd"]
