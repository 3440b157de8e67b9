"""The CPUs a process may use: cgroup quotas (v1 and v2) and affinity (runtime/cpu_quota.py).

The cgroup cases lay out /proc/self/{mountinfo,cgroup} and the cgroup folders as the kernel
writes them, in a temporary folder: setting a real quota needs root and a writable cgroup
filesystem, which a test runner does not always give. The affinity case is real: a child
process pinned to one CPU, where ONNX Runtime and the libraries' pools must follow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hopline.runtime.cpu_quota import (
    POOL_VARIABLES,
    cgroup_mounts,
    cpus_allowed,
    quota_cpus,
)

V2_MOUNT = "35 24 0:30 {root} {mountpoint} rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU_MOUNT = "40 33 0:35 {root} {mountpoint} rw,nosuid - cgroup cgroup rw,cpu,cpuacct"
V1_MEMORY_MOUNT = "41 33 0:36 / {mountpoint} rw,nosuid - cgroup cgroup rw,memory"
PROC_MOUNT = "22 1 0:5 / /proc rw,nosuid - proc proc rw"


def proc_folder(tmp_path: Path, mountinfo: list[str], cgroup: list[str]) -> Path:
    proc = tmp_path / "proc-self"
    proc.mkdir()
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    (proc / "cgroup").write_text("\n".join(cgroup) + "\n")
    return proc


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text + "\n")


def test_v2_leaf_quota_counts_whole_cpus(tmp_path: Path) -> None:
    """A Kubernetes container limited to 2.5 CPUs on a node of 64: 2 whole CPUs."""
    mount = tmp_path / "sys" / "fs" / "cgroup"
    write(mount, cpu_max="max 100000")
    write(mount / "kubepods" / "pod-a", cpu_max="max 100000")
    write(mount / "kubepods" / "pod-a" / "ctr", cpu_max="250000 100000")
    proc = proc_folder(
        tmp_path,
        [PROC_MOUNT, V2_MOUNT.format(root="/", mountpoint=mount)],
        ["0::/kubepods/pod-a/ctr"],
    )
    assert quota_cpus(proc) == pytest.approx(2.5)
    assert cpus_allowed(64, quota_cpus(proc)) == 2


def test_v2_parent_quota_binds_its_children(tmp_path: Path) -> None:
    """The container sets none, its pod 1.5 CPUs: the pod's limit holds."""
    mount = tmp_path / "cg"
    write(mount / "pod" / "ctr", cpu_max="max 100000")
    write(mount / "pod", cpu_max="150000 100000")
    proc = proc_folder(tmp_path, [V2_MOUNT.format(root="/", mountpoint=mount)], ["0::/pod/ctr"])
    assert quota_cpus(proc) == pytest.approx(1.5)
    assert cpus_allowed(8, quota_cpus(proc)) == 1


def test_v2_namespace_root_reads_the_mountpoint(tmp_path: Path) -> None:
    """Inside a cgroup namespace the process's cgroup is "/" and the mount shows it."""
    mount = tmp_path / "cg"
    write(mount, cpu_max="50000 100000")
    proc = proc_folder(tmp_path, [V2_MOUNT.format(root="/", mountpoint=mount)], ["0::/"])
    assert quota_cpus(proc) == pytest.approx(0.5)
    assert cpus_allowed(16, quota_cpus(proc)) == 1, "below one CPU still runs one thread"


def test_v1_cpu_controller_with_docker_style_root(tmp_path: Path) -> None:
    """cgroup v1 without a namespace: the mount's root is the container's own cgroup path,
    and the quota is in cpu.cfs_quota_us over cpu.cfs_period_us."""
    cpu = tmp_path / "sys fs" / "cpu,cpuacct"  # a space, escaped in mountinfo as \\040
    memory = tmp_path / "memory"
    write(cpu, cpu_cfs_quota_us="300000", cpu_cfs_period_us="100000")
    write(memory)
    escaped = str(cpu).replace(" ", "\\040")
    proc = proc_folder(
        tmp_path,
        [
            V1_MEMORY_MOUNT.format(mountpoint=memory),
            V1_CPU_MOUNT.format(root="/docker/abc", mountpoint=escaped),
        ],
        ["5:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/"],
    )
    assert [m.mountpoint for m in cgroup_mounts((proc / "mountinfo").read_text())] == [memory, cpu]
    assert quota_cpus(proc) == pytest.approx(3.0)
    assert cpus_allowed(2, quota_cpus(proc)) == 2, "the affinity is tighter than the quota"


def test_no_quota_or_no_cgroup_leaves_the_affinity(tmp_path: Path) -> None:
    mount = tmp_path / "cpu"
    write(mount, cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    unlimited = proc_folder(
        tmp_path, [V1_CPU_MOUNT.format(root="/", mountpoint=mount)], ["3:cpu,cpuacct:/"]
    )
    assert quota_cpus(unlimited) is None
    assert cpus_allowed(12, None) == 12
    assert quota_cpus(tmp_path / "no-such-proc") is None
    unmounted = tmp_path / "unmounted"
    unmounted.mkdir()
    (unmounted / "mountinfo").write_text(PROC_MOUNT + "\n")
    (unmounted / "cgroup").write_text("0::/user.slice\n")
    assert quota_cpus(unmounted) is None


CHILD = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from hopline.runtime.cpu_quota import fit_thread_pools, limited, usable_cpus
pools = fit_thread_pools()
from hopline.model.run_width import cores, run_slots
from hopline.model.session import session_options
from hopline.model.spin import Spin
options = session_options(0, Spin.OFF)
wide = session_options(3, Spin.OFF)
print(json.dumps({
    "limited": limited(), "usable": usable_cpus(), "cores": cores(), "slots": run_slots(0),
    "pools": pools, "env": {name: os.environ.get(name) for name in sys.argv[1:]},
    "intra_op": options.intra_op_num_threads, "explicit": wide.intra_op_num_threads,
}))
"""


def test_a_process_pinned_to_one_cpu_sizes_its_pools_to_it() -> None:
    """Real (the machine has 2 CPUs or more): a child pinned to one CPU sizes ONNX Runtime's
    intra-op pool, the run slots and the libraries' pools to one, and keeps what the operator
    set."""
    env = {k: v for k, v in os.environ.items() if k not in POOL_VARIABLES}
    env["OMP_NUM_THREADS"] = "3"  # set by the operator: kept
    result = subprocess.run(
        [sys.executable, "-c", CHILD, *POOL_VARIABLES],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(result.stdout)
    assert seen["limited"] is True
    assert seen["usable"] == seen["cores"] == 1
    assert seen["slots"] == 2
    assert seen["intra_op"] == 1, "ONNX Runtime's default would count the machine's cores"
    assert seen["explicit"] == 3, "an explicit thread count is the operator's"
    assert seen["pools"] == {"RAYON_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    assert seen["env"] == {
        "RAYON_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "3",
    }
