"""Thread niceness: model runs yield the CPU to the event loop instead of holding it.

A service's event loop does a request's short steps (receive, tokenize, batch, reply); a
model run is one long computation. When the two share cores, the scheduler treats them alike
by default, so a request's few hundred microseconds of loop work can wait behind a run's
time slice, and under load every request pays that wait at every step. Threads that run the
model are made nicer than the loop (on Linux niceness is per thread, and threads inherit
their creator's, so ONNX Runtime's own pool threads, made while a session is built on such a
thread, follow): the loop then preempts a run whenever it has work, and a run takes only
what the loop leaves. Measured in services/inference/service.py:InferenceConfig.nice.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("hopline.runtime.priority")

MAX_NICE = 19  # the least favoured niceness on Linux

T = TypeVar("T")


def lower_thread_priority(nice: int) -> int:
    """Make the calling thread `nice` steps nicer than the process's main thread (Linux;
    elsewhere niceness is per process, and this does nothing). A thread already that nice
    or nicer (one started by such a thread) is left alone, so the steps never add up.
    Returns the thread's niceness afterwards, or -1 where nothing was set."""
    if nice <= 0 or not sys.platform.startswith("linux"):
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


def thread_niceness() -> int:
    """The calling thread's niceness (Linux), for tests and logs."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def on_nicer_thread(nice: int, build: Callable[[], T]) -> T:
    """`build()` on a short-lived thread `nice` steps nicer: threads it starts (ONNX
    Runtime's pool, when it builds a session) inherit that niceness."""
    with ThreadPoolExecutor(1, initializer=lower_thread_priority, initargs=(nice,)) as thread:
        return thread.submit(build).result()


def nicer_executor(workers: int, prefix: str, nice: int) -> ThreadPoolExecutor:
    """A pool for model runs whose threads are `nice` steps nicer than the main thread."""
    return ThreadPoolExecutor(
        max_workers=workers,
        thread_name_prefix=prefix,
        initializer=lower_thread_priority,
        initargs=(nice,),
    )
