"""A milvus-lite file bounded as a whole (HOPLINE_CACHE_MAX_TOTAL_ENTRIES): past the bound the
(tenant, model)s holding the most give up their oldest, and a tenant within its fair share
keeps every entry. A real CacheService over a real milvus-lite file; a real `hopline serve
cache` for the settings it refuses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from cache_service import cache, lookup, run, scope, serve_cache, store_batch, written

from harness import free_port
from hopline.cache.counts import CacheCount
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

BOUND = 100  # the whole file's; a headroom of int(100 * 5%) = 5 below it after an eviction
EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS


async def kept(stub: object, tenant: str, texts: int) -> list[int]:
    """1 for each of the tenant's texts still answered EXACT, 0 for a miss, oldest first."""
    outcomes = []
    for i in range(texts):
        reply = await lookup(stub, f"{tenant} text {i}", scope=scope(tenant))
        assert reply.outcome in (EXACT, MISS), reply
        outcomes.append(int(reply.outcome == EXACT))
    return outcomes


def test_past_the_whole_file_bound_the_largest_groups_give_up_their_oldest(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db", max_total_entries=BOUND) as (service, stub):
            await stub.StoreBatch(store_batch("big", range(90)), timeout=10)
            await written(stub)
            assert service.counts[CacheCount.EVICTIONS] == 0  # 90 is within the bound
            await stub.StoreBatch(
                cache_pb2.StoreBatchRequest(
                    stores=[
                        *store_batch("small", range(10)).stores,
                        *store_batch("other", range(10)).stores,
                    ]
                ),
                timeout=10,
            )
            await written(stub)
            # 110 entries: 15 go (back to 95), all of them big's oldest.
            assert service.counts[CacheCount.EVICTIONS] == 15
            assert service.counts[CacheCount.FILE_EVICTIONS] == 15
            assert await kept(stub, "big", 90) == [0] * 15 + [1] * 75
            assert await kept(stub, "small", 10) == [1] * 10
            assert await kept(stub, "other", 10) == [1] * 10
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.entries == 95  # Milvus's count of the whole file

            # Two groups now far larger than the third: they come down to one level.
            await stub.StoreBatch(store_batch("small", range(10, 80)), timeout=10)
            await written(stub)
            # big 75, small 80, other 10: 165, so 70 go; big and small come down to 42 and
            # 43 (the odd one from the first by name), other keeps all of its 10.
            assert service.counts[CacheCount.EVICTIONS] == 15 + 70
            assert service.counts[CacheCount.FILE_EVICTIONS] == 15 + 70
            assert await kept(stub, "big", 90) == [0] * 48 + [1] * 42
            assert await kept(stub, "small", 80) == [0] * 37 + [1] * 43
            assert await kept(stub, "other", 10) == [1] * 10
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.entries == 95

    run(body)


def test_a_file_started_over_a_lowered_bound_comes_back_within_it(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"

    async def body() -> None:
        async with cache(db) as (_, stub):  # no whole-file bound yet
            await stub.StoreBatch(store_batch("big", range(40)), timeout=10)
            await stub.StoreBatch(store_batch("small", range(10)), timeout=10)
            await written(stub)
        async with cache(db, max_total_entries=30) as (service, stub):
            deadline = time.monotonic() + 20
            while not service.counts[CacheCount.EVICTIONS]:  # the writer's first step
                assert time.monotonic() < deadline, "the lowered bound was never applied"
                await asyncio.sleep(0.05)
            # 50 entries against 30: 21 go (a headroom of 1 below it), all big's oldest.
            assert service.counts[CacheCount.EVICTIONS] == 21
            assert service.counts[CacheCount.FILE_EVICTIONS] == 21
            assert await kept(stub, "big", 40) == [0] * 21 + [1] * 19
            assert await kept(stub, "small", 10) == [1] * 10
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.entries == 29

    run(body)


@pytest.mark.parametrize(
    ("where", "env", "says"),
    [
        ("server", {}, "a Milvus server's memory is sized on the server"),
        (
            "file",
            {"HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES": "1000"},
            "HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES of at least 1524",
        ),
    ],
)
def test_a_whole_file_bound_that_cannot_be_kept_stops_the_start(
    tmp_path: Path, where: str, env: dict[str, str], says: str
) -> None:
    uri = f"http://127.0.0.1:{free_port()}" if where == "server" else str(tmp_path / "c.db")
    code, log, _ = serve_cache(uri, env={"HOPLINE_CACHE_MAX_TOTAL_ENTRIES": "500", **env})
    assert code != 0
    assert says in log, log
