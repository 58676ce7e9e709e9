"""Which driver tree `serve` loads NVML from (NVIDIA loads it from containerDriverRoot)."""

from __future__ import annotations

from pathlib import Path

from kubegpu.config import Config, build_config
from kubegpu.daemon import driver_files_root


def flags(driver_root: str, container_root: Path | str) -> Config:
    return build_config(
        {
            "version": "v1",
            "flags": {
                "nvidiaDriverRoot": driver_root,
                "plugin": {"containerDriverRoot": str(container_root)},
            },
        },
        {},
        source="test",
    )


def test_a_mounted_driver_root_is_read_through_its_container_path(tmp_path: Path) -> None:
    # The GPU operator's driver container: host /run/nvidia/driver, mounted at /driver-root.
    config = flags("/run/nvidia/driver", tmp_path)
    assert driver_files_root(config.flags) == str(tmp_path)
    # Device nodes still go to the kubelet under the host's root.
    assert config.flags.dev_root == "/run/nvidia/driver"


def test_on_the_host_without_the_mount_the_host_path_is_used(tmp_path: Path) -> None:
    config = flags("/run/nvidia/driver", tmp_path / "not-mounted")
    assert driver_files_root(config.flags) == "/run/nvidia/driver"


def test_the_default_root_uses_the_loader_search_path(tmp_path: Path) -> None:
    assert driver_files_root(flags("/", tmp_path).flags) == "/"
