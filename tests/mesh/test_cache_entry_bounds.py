"""A scope at its entry bound keeps its newest entries without counting and scanning Milvus
on every write (cache/entry_bounds.py): a real CacheService over a real milvus-lite file,
its store's count and oldest-scan calls counted as they pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cache_service import cache, lookup, run, store, written

from hopline.cache.entry_bounds import HEADROOM
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

LIMIT = 300
STORES = 400
EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS


def counting(obj: Any, name: str, calls: dict[str, int]) -> None:
    """Count the calls to obj.name for one scope (GetStats and the reclaim check count the
    whole store), which still run."""
    real = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += bool(args)
        return real(*args, **kwargs)

    setattr(obj, name, counted)


def test_a_full_scope_evicts_its_oldest_a_headroom_at_a_time(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            calls = {"count": 0, "oldest": 0}
            for name in calls:
                counting(service.store, name, calls)
            texts = [f"entry number {i} about my parcel" for i in range(STORES)]
            for text in texts:  # one write each: the old rule counted Milvus after every one
                await store(stub, text, max_entries=LIMIT)
                await written(stub)
            stats = await stub.GetStats(cache_pb2.GetStatsRequest())
            kept = stats.entries
            assert LIMIT - int(LIMIT * HEADROOM) <= kept <= LIMIT, kept
            assert stats.evictions == STORES - kept
            # One count and one scan per HEADROOM + 1 writes past the bound, and one count
            # per write only while the scope is unknown (its first write).
            over = STORES - LIMIT
            per_eviction = int(LIMIT * HEADROOM) + 1
            assert calls["oldest"] <= over // per_eviction + 1, calls
            assert calls["count"] <= calls["oldest"] + 2 + STORES // 100, calls
            outcomes = [(await lookup(stub, t)).outcome for t in texts]
            assert set(outcomes[: STORES - kept]) == {MISS}
            assert set(outcomes[STORES - kept :]) == {EXACT}

    run(body)
