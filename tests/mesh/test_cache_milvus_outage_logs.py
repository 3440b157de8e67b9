"""A Milvus server that goes away under a running cache is said in the cache's log a few
times, not once per failed call: the replicas' shared invalidation log is read every 100 ms
and a write is retried every few seconds, and pymilvus logged every failed call at ERROR with
its traceback (ten a second for the log reads alone). A real CacheService in this process over
a real Milvus server (milvus-lite's own server by URI, tests/milvus_server.py), stopped under
it and started again."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from cache_service import cache, lookup, run, store, written
from milvus_server import MilvusKind, MilvusServer

from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

OUTAGE_S = 3.0
STONES_S = 1.0
MISS = common_pb2.CACHE_OUTCOME_MISS


def test_an_outage_is_logged_a_few_times_and_the_cache_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = MilvusServer(tmp_path / "milvus", MilvusKind.LITE_SERVER).start()
    try:

        async def body() -> None:
            async with cache(server.uri, milvus_timeout_s=2.0, peer_poll_ms=100) as (_, stub):
                await store(stub, "where is my parcel")
                await written(stub)
                caplog.clear()
                with caplog.at_level(logging.INFO):
                    server.stop()
                    await store(stub, "cancel my subscription")
                    await asyncio.sleep(OUTAGE_S)
                    outage = list(caplog.records)
                    server.start()
                    await written(stub)  # the write retried once Milvus is back
                errors = [r for r in outage if r.levelno >= logging.ERROR]
                assert not errors, [f"{r.name}: {r.getMessage()[:120]}" for r in errors]
                warnings = [r for r in outage if r.levelno == logging.WARNING]
                said = sorted({f"{r.name}: {r.getMessage()}" for r in warnings})
                # Once per shared log (invalidations, evidence), once per write retry (0.5, 1, 2 s).
                assert len(warnings) <= 6, said
                assert any("shared invalidation log" in line for line in said), said

        run(body)
    finally:
        server.stop()


def test_an_invalidation_milvus_cannot_delete_is_deleted_once_it_answers(tmp_path: Path) -> None:
    """Milvus's delete failing (a full disk in a cache probe) ended the Invalidate UNAVAILABLE
    and left the entries in Milvus: they were served again once the tombstones lapsed (60 of
    60), and after a restart for good. The cache holds them hidden, deletes them when Milvus
    answers again, and says so; a cache started afterwards does not find them."""
    server = MilvusServer(tmp_path / "milvus", MilvusKind.LITE_SERVER).start()
    text = "where is my parcel"
    try:

        async def body() -> None:
            async with cache(server.uri, milvus_timeout_s=2.0, tombstone_s=STONES_S) as (_, stub):
                await store(stub, text)
                await written(stub)
                server.stop()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Invalidate(
                        cache_pb2.InvalidateRequest(
                            scope=common_pb2.Scope(tenant="idx", model="m")
                        ),
                        timeout=30,
                    )
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                details = err.value.details() or ""
                assert details.startswith("not invalidated in Milvus yet: its delete failed")
                assert "the cache deletes them once Milvus answers" in details, details
                assert (await stats(stub)).pending_invalidations == 1
                server.start()
                deadline = time.monotonic() + 60
                while (await stats(stub)).pending_invalidations:
                    assert time.monotonic() < deadline, "the delete never landed"
                    await asyncio.sleep(0.1)
                await asyncio.sleep(STONES_S)  # the stones buried at the landing lapse
                assert (await lookup(stub, text)).outcome == MISS
            async with cache(server.uri, milvus_timeout_s=2.0) as (_, stub):  # a restart
                assert (await lookup(stub, text)).outcome == MISS

        run(body)
    finally:
        server.stop()


async def stats(stub: Any) -> cache_pb2.GetStatsResponse:
    reply: cache_pb2.GetStatsResponse = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    return reply
