"""When the cache counts a scope's entries in Milvus, and how many it evicts
(cache/entry_bounds.py); the service using it is tested in tests/mesh/test_cache_entry_bounds.py."""

from __future__ import annotations

import math
import random

from hopline.cache.entry_bounds import (
    HEADROOM,
    PRUNE_AT,
    EntryBounds,
    eviction_size,
    fair_shares,
    total_bound_problem,
)

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


def _one_at_a_time(counts: dict[tuple[str, str], int], excess: int) -> list[int]:
    """The counts left after taking `excess` entries one by one, each from the largest group."""
    left = dict(counts)
    for _ in range(min(excess, sum(left.values()))):
        largest = max(left, key=lambda group: left[group])
        left[largest] -= 1
    return sorted(left.values())


def test_the_whole_file_bound_takes_from_the_largest_groups() -> None:
    big, small, other = ("big", "m"), ("small", "m"), ("other", "m")
    assert fair_shares({big: 90, small: 10, other: 10}, 15) == {big: 15}
    assert fair_shares({big: 60, small: 60, other: 5}, 30) == {big: 15, small: 15}
    assert fair_shares({big: 10, small: 10}, 25) == {big: 10, small: 10}  # all there is
    assert fair_shares({big: 10}, 0) == {}
    rng = random.Random(7)
    for _ in range(300):
        counts = {(f"t{i}", "m"): rng.randrange(0, 50) for i in range(rng.randrange(1, 8))}
        excess = rng.randrange(0, sum(counts.values()) + 5)
        shares = fair_shares(counts, excess)
        assert sum(shares.values()) == min(excess, sum(counts.values())), (counts, excess)
        assert all(0 < share <= counts[group] for group, share in shares.items())
        left = sorted(counts[group] - shares.get(group, 0) for group in counts)
        assert left == _one_at_a_time(counts, excess), (counts, excess, shares)


def test_the_whole_file_bound_is_refused_where_it_cannot_be_kept() -> None:
    def problem(bound: int, local: bool = True, room: int | None = 2_000_000) -> str | None:
        return total_bound_problem(bound, local=local, index_room=room, batch=1024)

    assert problem(0, local=False, room=None) is None  # no bound, nothing to keep
    assert problem(100_000) is None
    assert "a Milvus server's memory is sized on the server" in (problem(100, local=False) or "")
    assert "HOPLINE_CACHE_EXACT_INDEX=true" in (problem(100, room=None) or "")
    too_small = problem(100_000, room=100_500) or ""
    assert "HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES of at least 101024" in too_small, too_small
