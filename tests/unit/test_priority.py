"""runtime/priority.py: threads made nicer than the process's main thread, and what they start."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from hopline.runtime.priority import lower_thread_priority, on_nicer_thread, thread_niceness

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
