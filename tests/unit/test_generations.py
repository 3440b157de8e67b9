"""Generation names of the cache's milvus-lite collection, which one a store opens after a
crash, and the gate that lets a reclaim switch generations with no call in flight."""

from __future__ import annotations

import threading
import time

import pytest

from hopline.cache import generations
from hopline.cache.generations import (
    Gate,
    current_and_abandoned,
    generation_name,
    generation_of,
)


def test_generation_names_round_trip_and_ignore_other_collections() -> None:
    assert generation_name("c", 0) == "c"
    assert generation_name("c", 3) == "c_g3"
    assert [generation_of("c", n) for n in ("c", "c_g1", "c_g12")] == [0, 1, 12]
    others = ("c_invalidations", "c_g", "c_g01", "c_gx", "d", "c_g1_g2", "cc_g1")
    assert [generation_of("c", n) for n in others] == [None] * len(others)


def test_the_lowest_generation_is_opened_and_copies_above_it_are_abandoned() -> None:
    assert current_and_abandoned("c", []) == ("c", [])
    assert current_and_abandoned("c", ["c_invalidations"]) == ("c", [])
    # Dropping the old generation is the commit: while it exists, the copy is unfinished.
    assert current_and_abandoned("c", ["c_g2", "other", "c"]) == ("c", ["c_g2"])
    assert current_and_abandoned("c", ["c_g10", "c_g9"]) == ("c_g9", ["c_g10"])
    assert current_and_abandoned("c", ["c_g4"]) == ("c_g4", [])


def test_a_hold_waits_for_running_calls_and_new_calls_wait_for_the_hold() -> None:
    gate = Gate()
    events: list[str] = []
    call_running = threading.Event()
    finish_call = threading.Event()

    def slow_call() -> None:
        with gate.call():
            call_running.set()
            finish_call.wait(5)
            events.append("call ended")

    def hold() -> None:
        with gate.held():
            events.append("held")
            time.sleep(0.05)
            events.append("released")

    def late_call() -> None:
        with gate.call():
            events.append("late call")

    first = threading.Thread(target=slow_call)
    first.start()
    assert call_running.wait(5)
    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.05)
    assert events == []  # the hold waits for the running call
    late = threading.Thread(target=late_call)
    late.start()
    time.sleep(0.05)
    assert events == []  # a call arriving while a hold waits is held back too
    finish_call.set()
    for t in (first, holder, late):
        t.join(5)
    assert events == ["call ended", "held", "released", "late call"]


def test_the_journal_records_writes_only_while_open() -> None:
    gate = Gate()

    def write(name: str) -> int:
        return 0

    gate.record(write)
    assert gate.take_journal() == []
    gate.open_journal()
    gate.record(write)
    assert gate.take_journal() == [write]
    gate.record(write)
    with gate.held():
        assert gate.close_journal() == [write]
    gate.record(write)
    assert gate.take_journal() == []


def test_the_journal_is_full_at_its_rows_and_empty_again_once_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(generations, "JOURNAL_MAX_ROWS", 100)
    gate = Gate()

    def write(name: str) -> int:
        return 0

    gate.record(write, 500)
    assert not gate.full()  # no journal open: nothing recorded
    gate.open_journal()
    gate.record(write, 60)
    assert not gate.full()
    gate.record(write, 40)
    assert gate.full()
    assert gate.take_journal() == [write, write]
    assert not gate.full()  # taken to be replayed: recording goes on into a fresh journal
    gate.record(write, 100)
    assert gate.full()
    with gate.held():
        gate.close_journal()
    assert not gate.full()
