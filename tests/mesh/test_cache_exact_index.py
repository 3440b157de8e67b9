"""The cache's exact tier answers from memory: the real CacheService (real milvus-lite file,
real gRPC server, in this process so its counters and store can be looked at) serves exact
hits without reading Milvus, rebuilds the index on restart, and drops expired, invalidated
and evicted entries from it.

One stand-in: to prove a lookup never reads Milvus, `milvus_reads_fail` replaces the store's
read by key with one that raises (an outage injected in this process; a real milvus-lite
cannot be made to fail reads alone while it keeps serving the rebuild and writes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cache_service import cache, lookup, run, scope, store, written

from hopline.cache.config import ExactFallback
from hopline.cache.counts import CacheCount
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.service import CacheService
from hopline.cache.store import CacheStoreError
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS


def milvus_reads_fail(service: CacheService) -> list[str]:
    """Every Milvus read by key now fails, as with Milvus down; returns the keys asked for."""
    asked: list[str] = []

    def get(key: str, now: float) -> None:
        asked.append(key)
        raise CacheStoreError("Milvus is down (test)")

    assert isinstance(service.store, MilvusStore)
    service.store.get = get  # type: ignore[method-assign]
    return asked


def test_exact_hits_are_answered_from_memory_without_milvus(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            await store(stub, "where is my parcel")
            # Visible at once, from the pending buffer, before Milvus has it.
            assert (await lookup(stub, "WHERE is my   parcel")).outcome == EXACT
            await written(stub)
            asked = milvus_reads_fail(service)
            before = {count: service.counts[count] for count in CacheCount}
            hit = await lookup(stub, "where is my parcel")
            assert hit.outcome == EXACT
            assert hit.prediction.label == "order_status"
            # An exact-only miss does not wait on Milvus either (default fallback: semantic).
            assert (await lookup(stub, "a question never stored")).outcome == MISS
            # Another tenant's identical text is another key: a miss, never this answer.
            other = await lookup(stub, "where is my parcel", scope=scope(tenant="idx-other"))
            assert other.outcome == MISS
            assert asked == []
            assert service.counts[CacheCount.INDEX_HITS] == before[CacheCount.INDEX_HITS] + 1
            assert service.counts[CacheCount.EXACT_READS] == before[CacheCount.EXACT_READS]
            # Nor a semantic-policy one on milvus-lite, one writer per file: the fallback read
            # is for a Milvus server, where another replica may have written the key.
            missed = await lookup(stub, "not stored either", mode="semantic", threshold=0.9)
            assert missed.outcome == MISS
            assert asked == []
            assert service.counts[CacheCount.EXACT_READS] == before[CacheCount.EXACT_READS]

    run(body)


def test_fallback_all_reads_milvus_on_an_index_miss(tmp_path: Path) -> None:
    async def body() -> None:
        db = tmp_path / "cache.db"
        async with cache(db, exact_fallback=ExactFallback.ALL) as (service, stub):
            key = await store(stub, "cancel my order")
            await written(stub)
            assert service.index is not None
            service.index.remove([key])  # as if another replica had written it
            before = service.counts[CacheCount.EXACT_READS]
            assert (await lookup(stub, "cancel my order")).outcome == EXACT
            assert service.counts[CacheCount.EXACT_READS] == before + 1

    run(body)


def test_a_restart_rebuilds_the_index(tmp_path: Path) -> None:
    texts = [f"how do I change my address, case {i}" for i in range(25)]

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (_, stub):
            for text in texts:
                await store(stub, text)
            await store(stub, "short lived", ttl_s=0.5)
            await written(stub)
        await asyncio.sleep(0.6)  # the short-lived entry expires while the cache is down
        async with cache(tmp_path / "cache.db") as (service, stub):
            assert service.counts[CacheCount.INDEX_REBUILT] == len(texts)
            asked = milvus_reads_fail(service)
            for text in texts:
                assert (await lookup(stub, text)).outcome == EXACT, text
            assert (await lookup(stub, "short lived")).outcome == MISS
            assert asked == []
            assert service.counts[CacheCount.INDEX_HITS] == len(texts)

    run(body)


def test_expiry_invalidation_and_eviction_leave_the_index(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db", sweep_interval_s=0.2) as (service, stub):
            index = service.index
            assert index is not None
            expiring = await store(stub, "expires soon", ttl_s=0.5)
            by_id = await store(stub, "dropped by id")
            kept = await store(stub, "kept", scope=scope(tenant="idx-b"))
            by_scope = await store(stub, "dropped by scope", scope=scope(tenant="idx-c"))
            await written(stub)
            assert all(k in index for k in (expiring, by_id, kept, by_scope))

            await asyncio.sleep(0.8)  # past the TTL and at least one sweep
            assert expiring not in index
            assert (await lookup(stub, "expires soon")).outcome == MISS

            await stub.Invalidate(cache_pb2.InvalidateRequest(entry_ids=[by_id]), timeout=10)
            await stub.Invalidate(
                cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant="idx-c")), timeout=10
            )
            assert by_id not in index
            assert by_scope not in index
            assert (await lookup(stub, "dropped by id")).outcome == MISS
            scoped = await lookup(stub, "dropped by scope", scope=scope(tenant="idx-c"))
            assert scoped.outcome == MISS
            assert (await lookup(stub, "kept", scope=scope(tenant="idx-b"))).outcome == EXACT

            small = scope(tenant="idx-evict")
            keys = []
            for i in range(4):
                keys.append(await store(stub, f"bounded {i}", scope=small, max_entries=2))
                await written(stub)
            assert [k in index for k in keys] == [False, False, True, True]
            outcomes = [(await lookup(stub, f"bounded {i}", scope=small)).outcome for i in range(4)]
            assert outcomes == [MISS, MISS, EXACT, EXACT]
            assert index.count("idx-evict", "m") == 2

    run(body)
