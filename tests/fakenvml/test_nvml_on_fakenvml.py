"""kubegpu's NVML backend through real pynvml on the simulated libnvidia-ml (../shared/fakenvml).

Machine layouts are the fakenvml README's (A100/H100 7-slice profile tables, its
examples/ machines, cited where used); expected names and IDs are NVIDIA's:
- MIG names: go-nvlib pkg/nvlib/device/mig_profile.go (`MigProfileInfo.String`,
  `getMigMemorySizeGB`) with the profile found by ID in mig_device.go (`GetProfile`),
  vendored in NVIDIA k8s-device-plugin v0.20.0;
- resource names: `nvidia.com/mig-<profile>` with `+` -> `.` (internal/rm/device_map.go);
- index IDs: `<gpu index>:<MIG device index>` (internal/rm/nvml_devices.go).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.origin import NVIDIA_DP
from tests.fakenvml.conftest import FAKENVML, Probe, fakenvml_env

EXAMPLES = FAKENVML / "examples"
NVLIB = "vendor/github.com/NVIDIA/go-nvlib/pkg/nvlib/device/"
MIG_NAMES = NVIDIA_DP.cite(NVLIB + "mig_profile.go")
MIG_INDEX = NVIDIA_DP.cite("internal/rm/nvml_devices.go")

A100_40GB = {"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0"}
H100_80GB = {
    "name": "NVIDIA H100 80GB HBM3",
    "memory_total": 85520809984,
    "compute_capability": "9.0",
}


def _machine(gpu: dict[str, Any], layouts: list[list[Any]]) -> dict[str, Any]:
    gpus = []
    for layout in layouts:
        migs = [m if isinstance(m, dict) else {"profile": m} for m in layout]
        gpus.append({**gpu, "mig_mode": True, "mig_devices": migs})
    return {"gpus": gpus}


def _names(result: dict[str, Any], strategy: str) -> dict[str, int]:
    return {name: len(devs) for name, devs in result["resources"][strategy].items()}


def _profiles(result: dict[str, Any]) -> list[list[str]]:
    return [[m["profile"] for m in g["migs"]] for g in result["gpus"]]


def test_a100_every_gi_profile_mixed(probe: Probe) -> None:
    """Every profile of the A100-40GB table, named as go-nvlib does (MIG_NAMES)."""
    result = probe(
        _machine(
            A100_40GB,
            [
                ["4g.20gb", "2g.10gb", "1g.10gb"],
                ["7g.40gb"],
                ["1g.5gb+me", "3g.20gb", "1g.5gb", "1g.5gb"],
                [{"profile": "1c.3g.20gb", "gi_id": 1}, {"profile": "2c.3g.20gb", "gi_id": 1}],
            ],
        ),
        "discover",
    )
    assert sorted(map(sorted, _profiles(result))) == sorted(
        map(
            sorted,
            [
                ["4g.20gb", "2g.10gb", "1g.10gb"],
                ["7g.40gb"],
                ["1g.5gb+me", "3g.20gb", "1g.5gb", "1g.5gb"],
                ["1c.3g.20gb", "2c.3g.20gb"],
            ],
        )
    )
    assert _names(result, "mixed") == {
        "nvidia.com/mig-1c.3g.20gb": 1,
        "nvidia.com/mig-1g.10gb": 1,
        "nvidia.com/mig-1g.5gb": 2,
        "nvidia.com/mig-1g.5gb.me": 1,
        "nvidia.com/mig-2c.3g.20gb": 1,
        "nvidia.com/mig-2g.10gb": 1,
        "nvidia.com/mig-3g.20gb": 1,
        "nvidia.com/mig-4g.20gb": 1,
        "nvidia.com/mig-7g.40gb": 1,
    }, MIG_NAMES
    # The two compute instances share one GPU instance.
    shared = result["gpus"][3]["migs"]
    assert {m["gi"] for m in shared} == {1} and sorted(m["ci"] for m in shared) == [0, 1]
    assert "error" in result["resources"]["single"]


def test_h100_every_gi_profile_mixed(probe: Probe) -> None:
    """Every profile of the H100-80GB table, named as go-nvlib does (MIG_NAMES): the 1g with
    two memory slices has profile ID 15, the index of ..._1_SLICE_ALL_ME, yet is plain 1g.20gb."""
    result = probe(
        _machine(
            H100_80GB,
            [
                ["4g.40gb", "2g.20gb", "1g.20gb"],
                ["1g.10gb+me", "3g.40gb", "1g.20gb", "1g.10gb"],
                ["7g.80gb"],
            ],
        ),
        "discover",
    )
    assert _names(result, "mixed") == {
        "nvidia.com/mig-1g.10gb": 1,
        "nvidia.com/mig-1g.10gb.me": 1,
        "nvidia.com/mig-1g.20gb": 2,
        "nvidia.com/mig-2g.20gb": 1,
        "nvidia.com/mig-3g.40gb": 1,
        "nvidia.com/mig-4g.40gb": 1,
        "nvidia.com/mig-7g.80gb": 1,
    }


@pytest.mark.parametrize(
    ("gpu", "profile", "gi_ids"),
    [(A100_40GB, "1g.5gb", range(7, 14)), (H100_80GB, "1g.10gb", range(7, 14))],
)
def test_seven_small_slices_single_and_mixed(
    probe: Probe, gpu: dict[str, Any], profile: str, gi_ids: range
) -> None:
    """7 slices per GPU on two GPUs: IDs `<gpu>:0..6` as NVIDIA's plugin sends them
    (MIG_INDEX), not the GPU-instance IDs 7..13."""
    result = probe(_machine(gpu, [[profile] * 7, [profile] * 7]), "discover")
    uuids = [m["uuid"] for g in result["gpus"] for m in g["migs"]]
    assert len(set(uuids)) == 14 and all(u.startswith("MIG-") for u in uuids)
    assert [m["gi"] for m in result["gpus"][0]["migs"]] == list(gi_ids)
    expected = [[u, f"{n // 7}:{n % 7}"] for n, u in enumerate(uuids)]
    assert result["resources"]["single"] == {"nvidia.com/gpu": expected}, MIG_INDEX
    assert result["resources"]["mixed"] == {f"nvidia.com/mig-{profile}": expected}


def test_media_and_graphics_attribute_profiles(probe: Probe) -> None:
    """`-me`, `+me.all`, `+gfx` profiles (Blackwell-style table given as `mig_profiles`; the
    IDs are ours, each distinct from every index), named as go-nvlib does (MIG_NAMES)."""
    table = [
        {"index": 0, "id": 19, "slices": 1, "instances": 7, "memory_mb": 4864},
        {"index": 13, "id": 21, "slices": 1, "instances": 7, "memory_mb": 4864, "attr": "-me"},
        {"index": 15, "id": 22, "slices": 1, "instances": 7, "memory_mb": 4864, "attr": "me.all"},
        {
            "index": 16,
            "id": 23,
            "slices": 2,
            "instances": 3,
            "memory_mb": 9728,
            "attr": "me.all",
            "memory_slices": 2,
        },
        {"index": 10, "id": 24, "slices": 1, "instances": 7, "memory_mb": 4864, "attr": "gfx"},
        {
            "index": 11,
            "id": 25,
            "slices": 2,
            "instances": 3,
            "memory_mb": 9728,
            "attr": "gfx",
            "memory_slices": 2,
        },
        {
            "index": 12,
            "id": 26,
            "slices": 4,
            "instances": 1,
            "memory_mb": 19456,
            "attr": "gfx",
            "memory_slices": 4,
        },
    ]
    layouts = [
        ["1g.5gb-me", "1g.5gb+me.all", "2g.10gb+me.all", "1g.5gb"],
        ["4g.20gb+gfx", "2g.10gb+gfx", "1g.5gb+gfx"],
    ]
    config = _machine(A100_40GB, layouts)
    for gpu in config["gpus"]:
        gpu["mig_profiles"] = table
    result = probe(config, "discover")
    assert sorted(p for g in _profiles(result) for p in g) == sorted(
        p for layout in layouts for p in layout
    )
    assert _names(result, "mixed") == {
        "nvidia.com/mig-1g.5gb": 1,
        "nvidia.com/mig-1g.5gb-me": 1,
        "nvidia.com/mig-1g.5gb.me.all": 1,
        "nvidia.com/mig-2g.10gb.me.all": 1,
        "nvidia.com/mig-1g.5gb.gfx": 1,
        "nvidia.com/mig-2g.10gb.gfx": 1,
        "nvidia.com/mig-4g.20gb.gfx": 1,
    }


def test_a100_example_uuids_indices_and_capability_nodes(
    probe: Probe, fakenvml_lib: Path, tmp_path: Path
) -> None:
    """fakenvml examples/a100-mig.json (3g.20gb + 2g.10gb + 2x 1g.5gb, placed 3g last),
    with the node's /proc capability files from fakeroot.py: each slice gets its GI and CI
    access nodes, and its index is its MIG device slot."""
    config = EXAMPLES / "a100-mig.json"
    subprocess.run(
        [
            sys.executable,
            str(FAKENVML / "fakeroot.py"),
            "--config",
            str(config),
            "--lib",
            str(fakenvml_lib),
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    result = probe(config, "discover", str(tmp_path))
    by_uuid = {m["uuid"]: m for m in result["gpus"][0]["migs"]}
    expected = {
        "MIG-f6268203-0b1f-436c-c018-8654b8105b26": ("3g.20gb", "0:0"),
        "MIG-65433f2c-f5c2-fc53-9a80-416d5164931e": ("2g.10gb", "0:1"),
        "MIG-32564ada-f40b-cbb1-f318-c6771ad280c0": ("1g.5gb", "0:2"),
        "MIG-d056cdc9-b7df-f0df-328b-b0ecd5315485": ("1g.5gb", "0:3"),
    }
    assert {u: (m["profile"], m["index"]) for u, m in by_uuid.items()} == expected
    for mig in by_uuid.values():
        # fakeroot.py's minors: GPU-instance access 3 + 9*gi, compute instance +1+ci.
        base = 3 + 9 * mig["gi"]
        assert mig["device_paths"] == [
            f"/dev/nvidia-caps/nvidia-cap{base}",
            f"/dev/nvidia-caps/nvidia-cap{base + 1 + mig['ci']}",
        ]
    assert result["resources"]["mixed"]["nvidia.com/mig-3g.20gb"] == [
        ["MIG-f6268203-0b1f-436c-c018-8654b8105b26", "0:0"]
    ]


def test_dgx1_direct_nvlinks(probe: Probe) -> None:
    """fakenvml examples/v100x8-dgx1.json: hybrid cube-mesh, the link counts of its config."""
    config = json.loads((EXAMPLES / "v100x8-dgx1.json").read_text())
    result = probe(EXAMPLES / "v100x8-dgx1.json", "discover")
    uuids = [g["uuid"] for g in result["gpus"]]
    for i, gpu in enumerate(config["gpus"]):
        wanted: dict[str, int] = {}
        for entry in gpu["nvlinks"]:
            peer = entry[0] if isinstance(entry, list) else entry
            wanted[uuids[peer]] = wanted.get(uuids[peer], 0) + 1
        links = result["gpus"][i]["links"]
        assert {p: c for p, (kind, c) in links.items() if kind == "NV"} == wanted
        # Peers without NVLink get their PCIe relation instead.
        assert len(links) == 7


def test_nvswitch_all_to_all(probe: Probe) -> None:
    """fakenvml examples/h100x8.json: 18 NVLinks per GPU through NVSwitches."""
    result = probe(EXAMPLES / "h100x8.json", "discover")
    for gpu in result["gpus"]:
        assert gpu["mig_enabled"] is False
        assert sorted(gpu["links"].values()) == [["NV", 18]] * 7


def test_xids_reach_the_health_tracker(probe: Probe, tmp_path: Path) -> None:
    """On examples/a100-mig.json: an Xid on one MIG slice (by MIG UUID, or by GPU + GPU/compute
    instance IDs) marks that slice only; an ignored Xid (13, an application error) and a
    corrected single-bit ECC error mark nothing; a GPU-wide Xid 79 or a double-bit ECC error
    marks the GPU and so every slice."""
    events = tmp_path / "events"
    events.write_text("# kubegpu test\n")
    slice_uuid = "MIG-65433f2c-f5c2-fc53-9a80-416d5164931e"
    small_uuid = "MIG-32564ada-f40b-cbb1-f318-c6771ad280c0"  # the first 1g.5gb: GI 9, CI 0
    gpu_uuid = "GPU-4f0cac3b-c11a-5097-b96a-6b845754ca32"
    config = EXAMPLES / "a100-mig.json"
    lines = ["sbe 0", f"xid {slice_uuid} 48", "xid 0 13", "xid 0 31 9 0"]
    result = probe(config, "watch", "3", *lines, events=events)
    assert result["complete"]
    assert result["events"] == [
        [slice_uuid, "xid", 48],
        [gpu_uuid, "xid", 13],
        [small_uuid, "xid", 31],
    ]
    # 31 is ignored by default too: only the slice with Xid 48 is unhealthy.
    assert result["unhealthy"] == [slice_uuid]
    result = probe(config, "watch", "2", "xid 0 79", "dbe 0", events=events)
    assert result["events"] == [[gpu_uuid, "xid", 79], [gpu_uuid, "xid", 48]]
    assert set(result["unhealthy"]) == {gpu_uuid} | {
        "MIG-f6268203-0b1f-436c-c018-8654b8105b26",
        slice_uuid,
        small_uuid,
        "MIG-d056cdc9-b7df-f0df-328b-b0ecd5315485",
    }


def test_kubegpu_info_on_the_simulated_a100(fakenvml_lib: Path) -> None:
    """The whole CLI (`kubegpu info`, default NVML backend) on examples/a100-mig.json."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, kubegpu.cli as c; sys.exit(c.main(['info']))"],
        env=fakenvml_env(fakenvml_lib, EXAMPLES / "a100-mig.json"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "backend: nvml" in done.stdout and "NVIDIA A100-SXM4-40GB" in done.stdout
    for line in (
        "MIG-f6268203-0b1f-436c-c018-8654b8105b26    MIG 3g.20gb (0:0)",
        "MIG-65433f2c-f5c2-fc53-9a80-416d5164931e    MIG 2g.10gb (0:1)",
        "MIG-32564ada-f40b-cbb1-f318-c6771ad280c0    MIG 1g.5gb (0:2)",
        "MIG-d056cdc9-b7df-f0df-328b-b0ecd5315485    MIG 1g.5gb (0:3)",
    ):
        assert line in done.stdout
