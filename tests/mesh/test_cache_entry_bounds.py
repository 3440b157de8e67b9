"""A scope at its entry bound keeps its newest entries without counting Milvus on every write
(cache/entry_bounds.py) or scanning it for the oldest while the exact index holds them all: a
real CacheService over a real milvus-lite file, its store's count and oldest-scan calls
counted as they pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cache_service import cache, lookup, run, scope, store, store_batch, written

from hopline.cache.counts import CacheCount
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


@pytest.mark.parametrize("index_room", [None, LIMIT // 2], ids=["index-holds-all", "index-small"])
def test_a_full_scope_evicts_its_oldest_a_headroom_at_a_time(
    tmp_path: Path, index_room: int | None
) -> None:
    """With the exact index holding every entry of the scope, the oldest are taken from it
    and Milvus is never scanned for them; with an index too small to hold the scope, Milvus
    is scanned once per eviction. Either way the newest entries are the ones kept."""

    async def body() -> None:
        room = {} if index_room is None else {"exact_index_max_entries": index_room}
        async with cache(tmp_path / "cache.db", **room) as (service, stub):
            calls = {"count": 0, "oldest": 0}
            for name in calls:
                counting(service.store, name, calls)
            texts = [f"entry number {i} about my parcel" for i in range(STORES)]
            ids = []
            for text in texts:  # one write each: the old rule counted Milvus after every one
                ids.append(await store(stub, text, max_entries=LIMIT))
                await written(stub)
            stats = await stub.GetStats(cache_pb2.GetStatsRequest())
            kept = stats.entries
            assert LIMIT - int(LIMIT * HEADROOM) <= kept <= LIMIT, kept
            assert stats.evictions == STORES - kept
            # One count per HEADROOM + 1 writes past the bound, and one count per write
            # only while the scope is unknown (its first write).
            over = STORES - LIMIT
            evictions = over // (int(LIMIT * HEADROOM) + 1) + 1
            assert calls["count"] <= evictions + 2 + STORES // 100, calls
            scans = service.counts[CacheCount.EVICTION_SCANS]
            assert calls["oldest"] == scans, (calls, scans)
            if index_room is None:
                assert scans == 0
            else:
                assert 1 <= scans <= evictions
            assert service.store is not None
            held = service.store.oldest(scope().tenant, scope().model, STORES)
            assert set(held) == set(ids[STORES - kept :])
            if index_room is None:  # an exact-only lookup reads the index alone
                outcomes = [(await lookup(stub, t)).outcome for t in texts]
                assert set(outcomes[: STORES - kept]) == {MISS}
                assert set(outcomes[STORES - kept :]) == {EXACT}

    run(body)


def test_the_scopes_over_their_bounds_after_one_write_share_one_delete(tmp_path: Path) -> None:
    """milvus-lite's delete costs about the same for one id as for thousands, so every
    scope's victims of one batched write go in one call."""
    bound, tenants = 40, ("a", "b", "c")

    async def body() -> None:
        # The default flush interval, so that one StoreBatch is one batched write.
        async with cache(tmp_path / "cache.db", flush_interval_ms=300.0) as (service, stub):
            calls = {"delete": 0}
            for tenant in tenants:  # each scope at its bound, no eviction yet
                await stub.StoreBatch(store_batch(tenant, range(bound), bound), timeout=10)
                await written(stub)
            counting(service.store, "delete", calls)
            batch = cache_pb2.StoreBatchRequest(
                stores=[
                    s
                    for t in tenants
                    for s in store_batch(t, range(bound, bound + 1), bound).stores
                ]
            )
            await stub.StoreBatch(batch, timeout=10)
            await written(stub)
            assert calls["delete"] == 1
            victims = 1 + int(bound * HEADROOM)
            assert service.counts[CacheCount.EVICTIONS] == victims * len(tenants)
            for tenant in tenants:
                outcomes = [
                    (await lookup(stub, f"{tenant} text {i}", scope=scope(tenant))).outcome
                    for i in range(bound + 1)
                ]
                assert outcomes == [MISS] * victims + [EXACT] * (bound + 1 - victims), tenant

    run(body)
