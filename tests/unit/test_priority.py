"""runtime/priority.py: threads made nicer than the process's main thread, and what they start."""

from __future__ import annotations

import os
import platform
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from hopline.runtime.priority import (
    lower_thread_priority,
    on_nicer_thread,
    set_thread_slice,
    thread_niceness,
    thread_slice_us,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's"
)


def _main_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def test_a_thread_is_made_nicer_than_the_main_thread_and_the_main_thread_is_not() -> None:
    with ThreadPoolExecutor(1, initializer=lower_thread_priority, initargs=(5,)) as pool:
        assert pool.submit(thread_niceness).result() == min(19, _main_nice() + 5)
    assert thread_niceness() == _main_nice()


def test_threads_started_on_a_nicer_thread_inherit_it_and_steps_do_not_add_up() -> None:
    def start_one() -> tuple[int, int]:
        inherited: list[int] = []
        child = threading.Thread(target=lambda: inherited.append(thread_niceness()))
        child.start()
        child.join()
        # A second request for the same steps, from a thread already that nice: unchanged.
        again = on_nicer_thread(5, thread_niceness)
        return inherited[0], again

    inherited, again = on_nicer_thread(5, start_one)
    assert inherited == again == min(19, _main_nice() + 5)


def test_zero_steps_change_nothing() -> None:
    assert on_nicer_thread(0, thread_niceness) == _main_nice()
    assert lower_thread_priority(0) == -1


def _kernel_honours_slices() -> bool:
    """A fair thread's requested slice is kept (and read back) from Linux 6.12 on; earlier
    kernels accept the call and ignore it."""
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found[1]), int(found[2])) >= (6, 12)


def test_a_slice_is_set_kept_with_the_niceness_and_inherited_by_threads_it_starts() -> None:
    def start_one() -> tuple[bool, int, int, int]:
        inherited: list[int] = []
        child = threading.Thread(target=lambda: inherited.append(thread_slice_us()))
        child.start()
        child.join()
        return set_thread_slice(100), thread_slice_us(), inherited[0], thread_niceness()

    accepted, own, inherited, nice = on_nicer_thread(5, start_one, slice_us=100)
    assert accepted, "sched_setattr refused a fair thread's slice"
    assert nice == min(19, _main_nice() + 5), "setting the slice lost the niceness"
    if _kernel_honours_slices():
        assert own == inherited == 100
        assert thread_slice_us() != 100, "the main thread's slice changed"


def test_no_slice_leaves_the_kernels_default() -> None:
    main_slice = thread_slice_us()
    assert on_nicer_thread(5, thread_slice_us, slice_us=0) == main_slice
