"""Thread niceness: model runs yield the CPU to the event loop instead of holding it.

A service's event loop does a request's short steps (receive, tokenize, batch, reply); a
model run is one long computation. When the two share cores, the scheduler treats them alike
by default, so a request's few hundred microseconds of loop work can wait behind a run's
time slice, and under load every request pays that wait at every step. Threads that run the
model are made nicer than the loop (on Linux niceness is per thread, and threads inherit
their creator's, so ONNX Runtime's own pool threads, made while a session is built on such a
thread, follow): the loop then preempts a run whenever it has work, and a run takes only
what the loop leaves. Measured in services/inference/service.py:InferenceConfig.nice.

Niceness sets a run's share, not how soon the loop gets a core back: since Linux 6.6 the
scheduler (EEVDF) lets a running thread finish a protected slice before a woken thread
preempts it, 0.7 ms x (1 + log2 cores) by default (1.4 ms on 2 cores), and an intra-op
thread spinning between operators holds its core that long while the loop waits to hand a
reply back. So model threads also ask for the shortest slice the kernel grants
(`sched_setattr`'s `sched_runtime`, Linux 6.12 and later; kernels before that ignore it):
their share is unchanged, and a woken loop preempts a run within about 0.1 ms. Measured in
services/inference/service.py:InferenceConfig.slice_us.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("hopline.runtime.priority")

MAX_NICE = 19  # the least favoured niceness on Linux
# sched_setattr(2) and sched_getattr(2) by architecture (glibc wraps neither).
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}
# struct sched_attr as of its first version (48 bytes): size, policy, flags, nice, priority,
# runtime, deadline, period (sched_runtime, in ns, is a fair thread's slice since 6.12).
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")
_FAIR_POLICIES = (os.SCHED_OTHER, os.SCHED_BATCH)

T = TypeVar("T")


def lower_thread_priority(nice: int, slice_us: int = 0) -> int:
    """Make the calling thread `nice` steps nicer than the process's main thread (Linux;
    elsewhere niceness is per process, and this does nothing) and, with `slice_us`, ask for
    that slice. A thread already that nice or nicer (one started by such a thread) keeps its
    niceness, so the steps never add up. Returns the thread's niceness afterwards, or -1
    where nothing was set."""
    if not sys.platform.startswith("linux"):
        return -1
    if slice_us > 0:
        set_thread_slice(slice_us)
    if nice <= 0:
        return -1
    tid = threading.get_native_id()
    try:
        # PRIO_PROCESS with the process id reads the main thread's niceness on Linux.
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) >= target:
            return target
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as exc:  # a sandbox that forbids it: run at the loop's priority
        log.warning("could not lower a model thread's priority", extra={"error": str(exc)})
        return -1
    return target


def _sched_attr(tid: int) -> tuple[int, ...] | None:
    """The thread's struct sched_attr fields, or None where it cannot be read."""
    number = _SCHED_GETATTR.get(platform.machine())
    if number is None:
        return None
    buffer = ctypes.create_string_buffer(_SCHED_ATTR.size)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, tid, buffer, _SCHED_ATTR.size, 0) != 0:
        return None
    return _SCHED_ATTR.unpack(buffer.raw)


def set_thread_slice(slice_us: int) -> bool:
    """Ask for a `slice_us` scheduler slice for the calling thread, keeping its policy and
    niceness; threads it starts inherit it. False (logged) where the kernel or sandbox
    refuses; a kernel before 6.12 accepts and ignores it."""
    tid = threading.get_native_id()
    number = _SCHED_SETATTR.get(platform.machine())
    current = _sched_attr(tid)
    if number is None or current is None:
        log.warning("could not set a model thread's slice", extra={"error": "no sched_setattr"})
        return False
    policy, nice = current[1], current[3]
    if policy not in _FAIR_POLICIES:
        return False  # a real-time or idle thread: its policy has no slice to shorten
    attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, policy, 0, nice, 0, slice_us * 1000, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, tid, ctypes.create_string_buffer(attr, len(attr)), 0) != 0:
        error = os.strerror(ctypes.get_errno())
        log.warning("could not set a model thread's slice", extra={"error": error})
        return False
    return True


def thread_slice_us() -> int:
    """The calling thread's scheduler slice in microseconds (0 where it cannot be read), for
    tests and logs."""
    attr = _sched_attr(threading.get_native_id())
    return attr[5] // 1000 if attr is not None else 0


def thread_niceness() -> int:
    """The calling thread's niceness (Linux), for tests and logs."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def on_nicer_thread(nice: int, build: Callable[[], T], slice_us: int = 0) -> T:
    """`build()` on a short-lived thread `nice` steps nicer (with `slice_us`, that slice):
    threads it starts (ONNX Runtime's pool, when it builds a session) inherit both."""
    with ThreadPoolExecutor(
        1, initializer=lower_thread_priority, initargs=(nice, slice_us)
    ) as thread:
        return thread.submit(build).result()


def nicer_executor(workers: int, prefix: str, nice: int, slice_us: int = 0) -> ThreadPoolExecutor:
    """A pool for model runs whose threads are `nice` steps nicer than the main thread (and
    with `slice_us`, have that slice)."""
    return ThreadPoolExecutor(
        max_workers=workers,
        thread_name_prefix=prefix,
        initializer=lower_thread_priority,
        initargs=(nice, slice_us),
    )
