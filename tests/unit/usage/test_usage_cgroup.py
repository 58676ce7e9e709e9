"""A process's pod from its cgroup file: the kubelet's layouts, and garbage in /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kubegpu.usage.cgroup import MAX_CGROUP_BYTES, PodCgroup, parse_cgroup, read_cgroup

UID = "3f1c2b9e-6a55-4d3e-9c1b-7a2e8d4f0b61"
CID = "a" * 60 + "0f1e"


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v2, systemd driver, containerd (the dashes of the UID written as `_`)
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        # CRI-O, a Guaranteed pod (directly under kubepods.slice)
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
        # cgroupfs driver
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        # read through a cgroup namespace: the path is relative to the reader's root
        f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope",
        # cgroup v1: one line per hierarchy, the pod on any of them
        f"12:pids:/user.slice\n4:memory:/kubepods/burstable/pod{UID}/{CID}\n"
        f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n",
    ],
)
def test_the_kubelets_layouts(text: str) -> None:
    assert parse_cgroup(text) == PodCgroup(UID, CID)


def test_a_static_pod_uid_is_a_hash_and_a_sandbox_has_no_container() -> None:
    static = "0f" * 16
    assert parse_cgroup(f"0::/kubepods/pod{static}\n") == PodCgroup(static, "")


@pytest.mark.parametrize(
    "text",
    [
        "0::/system.slice/nvidia-persistenced.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        f"0::/kubepods.slice/mypod{UID}.slice\n",  # not the kubelet's pod segment
        "garbage without colons\n",
        "",
    ],
)
def test_outside_pods_is_none(text: str) -> None:
    assert parse_cgroup(text) is None


def write(root: Path, pid: int, data: bytes) -> Path:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    path = root / str(pid) / "cgroup"
    path.write_bytes(data)
    return path


def test_read_from_a_proc_root(tmp_path: Path) -> None:
    write(tmp_path, 42, f"0::/kubepods/burstable/pod{UID}/{CID}\n".encode())
    assert read_cgroup(tmp_path, 42) == PodCgroup(UID, CID)


def test_garbage_in_proc_reads_as_unknown(tmp_path: Path) -> None:
    good = f"0::/kubepods/burstable/pod{UID}/{CID}\n".encode()
    # huge: a real file is a few hundred bytes; past the bound it is not read at all
    write(tmp_path, 1, good + b"x" * MAX_CGROUP_BYTES)
    # not UTF-8 around a valid line: the valid line still counts
    write(tmp_path, 2, b"\xff\xfe\x00garbage\n" + good)
    # a FIFO would block a plain open/read forever
    (tmp_path / "3").mkdir()
    os.mkfifo(tmp_path / "3" / "cgroup")
    # a symlink out of the tree, a directory, a process that is gone, a silly pid
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "cgroup").symlink_to(write(tmp_path, 99, good))
    (tmp_path / "5" / "cgroup").mkdir(parents=True)
    assert read_cgroup(tmp_path, 1) is None
    assert read_cgroup(tmp_path, 2) == PodCgroup(UID, CID)
    assert read_cgroup(tmp_path, 3) is None
    assert read_cgroup(tmp_path, 4) is None
    assert read_cgroup(tmp_path, 5) is None
    assert read_cgroup(tmp_path, 6) is None
    assert read_cgroup(tmp_path, 0) is None and read_cgroup(tmp_path, -1) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_reads_as_unknown(tmp_path: Path) -> None:
    path = write(tmp_path, 7, f"0::/kubepods/pod{UID}\n".encode())
    path.chmod(0)
    assert read_cgroup(tmp_path, 7) is None


def test_the_real_proc_of_this_process_reads_without_error() -> None:
    # Outside a pod here (or inside one in CI): either way an answer, never an exception.
    found = read_cgroup(Path("/proc"), os.getpid())
    assert found is None or len(found.pod_uid) in (32, 36)
