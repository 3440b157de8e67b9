"""What `make bench` ran on, in its report's header: the CPU, the kernel and what an idle core
does.

The last decides much of a c=1 row on a virtual machine: an idle vCPU that halts at once
leaves the guest, and the next wake-up finds its core cold. On the project's Firecracker VMs
(`cpuidle-haltpoll` with `haltpoll.guest_halt_poll_ns=0` on the kernel's command line) an echo
at c=1 took 0.31-0.49 ms, and 0.15-0.19 with the guest polling up to 0.2-3 ms before it
halts (docs/performance.md, "Guest halt polling"). Two runs on one VM type but different idle
settings are not comparable, so the report says which it had.
"""

from __future__ import annotations

import platform
from pathlib import Path

HALT_POLL = "module/haltpoll/parameters/guest_halt_poll_ns"
CPUIDLE = "devices/system/cpu/cpuidle"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_model(proc: Path = Path("/proc")) -> str:
    """The first CPU's model name, as /proc/cpuinfo gives it ('unknown' without one)."""
    for line in (_read(proc / "cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return "unknown"


def idle_setting(sysfs: Path = Path("/sys")) -> str:
    """The cpuidle driver and governor, and the guest's halt polling where the haltpoll
    driver is loaded: 'haltpoll/haltpoll, guest halt polling 0 ns'."""
    driver = _read(sysfs / CPUIDLE / "current_driver")
    governor = _read(sysfs / CPUIDLE / "current_governor") or _read(
        sysfs / CPUIDLE / "current_governor_ro"
    )
    said = f"{driver or 'none'}/{governor or 'none'}"
    poll = _read(sysfs / HALT_POLL)
    return said if poll is None else f"{said}, guest halt polling {poll} ns"


def describe(proc: Path = Path("/proc"), sysfs: Path = Path("/sys")) -> dict[str, str]:
    return {"cpu": cpu_model(proc), "kernel": platform.release(), "idle": idle_setting(sysfs)}
