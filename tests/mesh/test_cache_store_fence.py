"""A store that reaches the cache just after an invalidation of its entry is not taken.

The gateway holds its stores up to HOPLINE_GATEWAY_STORE_LINGER_MS (500 ms) before it sends
them, so an answer computed before an Invalidate could land after it and be served again for
its whole TTL (found by probing: Predict, Invalidate the tenant within 200 ms, and 1.5 s later
the same text was an EXACT hit). The cache now refuses, ABORTED, a store of an id or scope
invalidated within HOPLINE_CACHE_TOMBSTONE_S (cache/tombstones.py:Tombstones.fences). Real
CacheService and milvus-lite file in this process; the late store is sent by the test as the
gateway's lingering one would be; the whole path through a mesh is the last test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cache_service import cache, lookup, run, scope, store

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.cache.counts import CacheCount
from hopline.gateway.client import predict
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2

KEEP_S = 0.6  # the test's tombstones: long enough to send the late store, short to wait out
EXACT, MISS = common_pb2.CACHE_OUTCOME_EXACT, common_pb2.CACHE_OUTCOME_MISS


def test_a_late_store_of_an_invalidated_scope_or_id_is_refused_then_taken_again(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with cache(tmp_path / "c.db", tombstone_s=KEEP_S) as (service, stub):
            await store(stub, "where is my order", scope=scope("t1"))
            kept = await store(stub, "cancel my order", scope=scope("t1"))
            other = await store(stub, "where is my order", scope=scope("t2"))
            await stub.Invalidate(
                cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant="t1")), timeout=10
            )
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await store(stub, "where is my order", scope=scope("t1"))
            assert late.value.code() == grpc.StatusCode.ABORTED
            assert "invalidated within the last 0.6 s" in (late.value.details() or "")
            assert (await lookup(stub, "where is my order", scope=scope("t1"))).outcome == MISS
            assert service.counts[CacheCount.STORES_FENCED] == 1
            # Another tenant's store is not fenced, nor is it touched.
            assert (await lookup(stub, "where is my order", scope=scope("t2"))).outcome == EXACT
            await store(stub, "where is my order", scope=scope("t2"))

            # By id: that entry alone.
            await asyncio.sleep(KEEP_S + 0.1)
            await store(stub, "cancel my order", scope=scope("t1"))
            await stub.Invalidate(cache_pb2.InvalidateRequest(entry_ids=[kept]), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await store(stub, "cancel my order", scope=scope("t1"))
            assert again.value.code() == grpc.StatusCode.ABORTED
            await store(stub, "a different text", scope=scope("t1"))

            # Once the stone is gone a store is taken and served.
            await asyncio.sleep(KEEP_S + 0.1)
            await store(stub, "where is my order", scope=scope("t1"))
            assert (await lookup(stub, "where is my order", scope=scope("t1"))).outcome == EXACT
            assert other

    run(scenario)


@pytest.fixture(scope="module")
def fmesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("fence")
    m = Mesh(default_repo, work, HOPLINE_CACHE_BUDGET_MS="2000")
    try:
        yield m.start()
    finally:
        m.stop()


def test_an_answer_computed_before_an_invalidate_is_not_served_after_it(fmesh: Mesh) -> None:
    """The probe's steps: a miss, its tenant invalidated while the store still lingers in
    the gateway, and the same text a moment later."""
    text, tenant = "my parcel never arrived", "fence-t"
    first = predict(text, gateway=fmesh.gateway, tenant=tenant, model=DEFAULT_MODEL, timeout_s=60)
    assert first.cache.outcome == MISS
    with grpc.insecure_channel(fmesh.addrs["cache"]) as channel:
        cache_pb2_grpc.CacheServiceStub(channel).Invalidate(
            cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant=tenant)), timeout=10
        )
    time.sleep(1.5)  # the gateway's linger (500 ms) and its store call are long over
    again = predict(text, gateway=fmesh.gateway, tenant=tenant, model=DEFAULT_MODEL, timeout_s=60)
    assert again.cache.outcome == MISS, again.cache


def test_an_invalidate_counts_the_entries_not_yet_written(tmp_path: Path) -> None:
    """Stores still pending (not in Milvus yet) were removed but not counted: an Invalidate
    right after three stores said it had removed 0."""

    async def scenario() -> None:
        async with cache(tmp_path / "c.db", flush_interval_ms=60_000.0) as (_, stub):
            for text in ("one", "two", "three"):
                await store(stub, text, scope=scope("pending"))
            reply = await stub.Invalidate(
                cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant="pending")), timeout=10
            )
            assert reply.removed == 3
            assert (await lookup(stub, "one", scope=scope("pending"))).outcome == MISS

    run(scenario)
