"""When the cache counts a scope's entries in Milvus, and how many it evicts
(cache/entry_bounds.py); the service using it is tested in tests/mesh/test_cache_entry_bounds.py."""

from __future__ import annotations

import math

from hopline.cache.entry_bounds import HEADROOM, PRUNE_AT, EntryBounds, eviction_size

GROUP = ("tenant", "model")


def test_eviction_goes_a_headroom_below_the_bound() -> None:
    assert eviction_size(100_000, 100_000) == 0
    assert eviction_size(100_001, 100_000) == 1 + int(100_000 * HEADROOM)
    assert eviction_size(5, 3) == 2  # small bounds stay exact


def test_a_scope_is_counted_first_then_when_it_may_be_over_or_its_count_is_old() -> None:
    bounds = EntryBounds(refresh_s=10.0)
    assert bounds.needs_count(GROUP, 100, now=0.0)
    bounds.counted(GROUP, 90, now=0.0)
    bounds.wrote(GROUP, 10)
    assert not bounds.needs_count(GROUP, 100, now=1.0)
    bounds.wrote(GROUP, 1)
    assert bounds.needs_count(GROUP, 100, now=1.0)
    bounds.counted(GROUP, 101, now=1.0)
    bounds.evicted(GROUP, 2)
    assert not bounds.needs_count(GROUP, 100, now=2.0)
    # Another replica's writes are not seen here: the count is taken again once it is old.
    assert bounds.needs_count(GROUP, 100, now=11.0)
    assert bounds.needs_count(("other", "model"), 100, now=2.0)


def test_with_many_tenants_only_the_groups_counted_lately_are_held() -> None:
    bounds = EntryBounds(refresh_s=10.0)
    for i in range(PRUNE_AT):
        bounds.counted((f"tenant-{i}", "model"), 1, now=0.0)
    bounds.counted(GROUP, 1, now=20.0)  # one more: the stale ones go
    assert len(bounds) == 1
    assert not bounds.needs_count(GROUP, 100, now=21.0)
    assert bounds.needs_count(("tenant-0", "model"), 100, now=21.0)


def test_one_writer_counts_again_only_past_the_bound() -> None:
    bounds = EntryBounds(refresh_s=math.inf)  # a milvus-lite file: no other replica writes
    bounds.counted(GROUP, 90, now=0.0)
    bounds.wrote(GROUP, 10)
    assert not bounds.needs_count(GROUP, 100, now=1e6)
    bounds.wrote(GROUP, 1)
    assert bounds.needs_count(GROUP, 100, now=1e6)


def test_with_no_refresh_many_tenants_keep_the_latest_counted_half() -> None:
    bounds = EntryBounds(refresh_s=math.inf)
    for i in range(PRUNE_AT + 1):
        bounds.counted((f"tenant-{i}", "model"), 1, now=float(i))
    assert len(bounds) == PRUNE_AT // 2
    assert not bounds.needs_count((f"tenant-{PRUNE_AT}", "model"), 100, now=1e6)
    assert bounds.needs_count(("tenant-0", "model"), 100, now=1e6)  # counted again when written
