"""The CPUs a process may use: its affinity, and the CPU quota of its cgroups.

A container with a CPU limit (Kubernetes `resources.limits.cpu`, `docker run --cpus`) sees
every core of its node: `os.cpu_count()` and the affinity mask say 64 while the kernel lets
it run 2 cores' worth each period and stops it for the rest. ONNX Runtime sizes its thread
pool from the machine's cores too, so a model run would spread over 64 threads that spin
through the quota in a fraction of the period and then all wait, throttled, for the next.
Go's automaxprocs and the JVM's container support read the same files for the same reason.

The quota is read from the cgroup filesystems in /proc/self/mountinfo, for the cgroups in
/proc/self/cgroup: cgroup v2's `cpu.max` ("max 100000" or "200000 100000") and cgroup v1's
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none), at the process's cgroup and every one
above it up to the mount (a parent's limit binds its children). A quota of 2.5 CPUs counts
as 2: a pool of 3 busy threads would be throttled every period.
"""

from __future__ import annotations

import enum
import functools
import math
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PROC_SELF = Path("/proc/self")


class CgroupVersion(enum.IntEnum):
    V1 = 1  # one hierarchy per controller set; the quota in cpu.cfs_quota_us / cfs_period_us
    V2 = 2  # one unified hierarchy; the quota in cpu.max


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup filesystem as /proc/self/mountinfo lists it."""

    root: PurePosixPath  # the cgroup path the mount shows at its mountpoint
    mountpoint: Path
    version: CgroupVersion
    controllers: frozenset[str]  # v1: the controllers mounted there; v2: empty


def cgroup_mounts(mountinfo: str) -> list[CgroupMount]:
    """Every cgroup (v1) and cgroup2 mount in a mountinfo text (proc(5) gives its fields)."""
    mounts: list[CgroupMount] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or dash < 5:
            continue
        fstype, super_options = fields[dash + 1], fields[dash + 3]
        root, mountpoint = PurePosixPath(_unescape(fields[3])), Path(_unescape(fields[4]))
        if fstype == "cgroup2":
            mounts.append(CgroupMount(root, mountpoint, CgroupVersion.V2, frozenset()))
        elif fstype == "cgroup":
            controllers = frozenset(super_options.split(","))
            mounts.append(CgroupMount(root, mountpoint, CgroupVersion.V1, controllers))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    for octal, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(octal, char)
    return field


def cpu_cgroup_dirs(cgroup: str, mounts: list[CgroupMount]) -> Iterator[tuple[CgroupMount, Path]]:
    """(mount, folder) of each cgroup of this process that can hold a CPU quota: the v2
    cgroup, and the v1 cgroup of the `cpu` controller, where they are mounted."""
    for line in cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        v1 = not (hierarchy == "0" and controllers == "")
        if v1 and "cpu" not in controllers.split(","):
            continue
        version = CgroupVersion.V1 if v1 else CgroupVersion.V2
        for mount in mounts:
            if mount.version is not version or (v1 and "cpu" not in mount.controllers):
                continue
            cgroup_path = PurePosixPath(path)
            # A container's own cgroup is usually the root of what it mounts; where the path
            # is not below the mount's root (a namespace's quirk), the mountpoint is the best
            # guess, as the JVM's container support takes it.
            if cgroup_path.is_relative_to(mount.root):
                yield mount, mount.mountpoint / cgroup_path.relative_to(mount.root)
            else:
                yield mount, mount.mountpoint
            break


def folder_quota(version: CgroupVersion, folder: Path) -> float | None:
    """The CPUs one cgroup folder's quota allows, or None where it sets none (or is unread)."""
    try:
        if version is CgroupVersion.V2:
            quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or "100000")
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        if quota_us <= 0:
            return None
        return quota_us / int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def quota_cpus(proc: Path = PROC_SELF) -> float | None:
    """The tightest CPU quota over this process's cgroups and their parents (in CPUs), or None
    where none is set or the files cannot be read (not Linux, no cgroup filesystem)."""
    try:
        mounts = cgroup_mounts((proc / "mountinfo").read_text())
        cgroup = (proc / "cgroup").read_text()
    except OSError:
        return None
    quotas: list[float] = []
    for mount, folder in cpu_cgroup_dirs(cgroup, mounts):
        level = folder
        while True:
            quota = folder_quota(mount.version, level)
            if quota is not None:
                quotas.append(quota)
            if level == mount.mountpoint or not level.is_relative_to(mount.mountpoint):
                break
            level = level.parent
    return min(quotas) if quotas else None


def cpus_allowed(affinity: int, quota: float | None) -> int:
    """The whole CPUs a process may keep busy: its affinity, no more than its quota, at least 1."""
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.floor(quota + 1e-9)))


@functools.cache
def usable_cpus() -> int:
    """This process's whole CPUs (affinity and quota), read once, as the pools it sizes are
    made once: a limit changed in place (Kubernetes' pod resize) is seen after a restart."""
    return cpus_allowed(len(os.sched_getaffinity(0)), quota_cpus())


@functools.cache
def physical_cores(sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """The physical cores among this process's CPUs (two hyperthreads of one core count
    once), no more than its whole CPUs (`usable_cpus`): ONNX Runtime's own way of counting
    (one thread per physical core), kept within the process's affinity and quota. Where the
    topology cannot be read, every CPU counts as a core."""
    cores: set[tuple[str, str]] = set()
    for cpu in os.sched_getaffinity(0):
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            package, core = "cpu", str(cpu)
        cores.add((package, core))
    return max(1, min(len(cores), usable_cpus()))


def machine_cpus() -> int:
    """The machine's CPUs, as libraries that size their own thread pools count them."""
    return os.cpu_count() or 1


def limited() -> bool:
    """True where affinity or a quota leaves this process fewer CPUs than the machine has,
    so a library's own default thread count would be too many."""
    return usable_cpus() < machine_cpus()


# Thread pools that size themselves from the machine's CPUs when they start: the `tokenizers`
# Rust pool (rayon), and OpenBLAS under numpy's matrix products (the cache's in-memory search).
POOL_VARIABLES = ("RAYON_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def fit_thread_pools(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Size the libraries' own thread pools to the usable CPUs where those are fewer than the
    machine's, unless the operator set them. Call before numpy or `tokenizers` start a pool;
    returns what it set, for the start-up log."""
    env = os.environ if environ is None else environ
    if not limited():
        return {}
    chosen = {name: str(usable_cpus()) for name in POOL_VARIABLES if name not in env}
    env.update(chosen)
    return chosen
