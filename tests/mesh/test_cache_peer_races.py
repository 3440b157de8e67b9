"""Two cache replicas over one Milvus server (milvus-lite's own, by URI): the races between
one replica's invalidation and the other's writes and reads that the shared log alone left
open (cache/peer_sync.py), found by a probe of two replicas and two gateways.

Real CacheServices in this process over a real server process; a replica's poll of the
shared log is made by the test where its moment decides the race (the replica's own poll
is set to never come), as the follower makes it (cache/shared_invalidations.py:follow).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from cache_service import cache, lookup, run, scope, store, written
from milvus_server import MilvusKind, MilvusServer

from hopline.cache import invalidation
from hopline.cache.service import CacheService
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

EXACT, MISS = common_pb2.CACHE_OUTCOME_EXACT, common_pb2.CACHE_OUTCOME_MISS
STONES_S = 0.5  # tombstones short enough to wait out: the stale row is served after them
NEVER_MS = 3_600_000.0  # a replica whose poll the test makes itself


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MilvusServer]:
    started = MilvusServer(tmp_path_factory.mktemp("peer-races"), MilvusKind.LITE_SERVER)
    started.start()
    try:
        yield started
    finally:
        started.stop()


async def poll(replica: CacheService) -> None:
    """The replica's follower's one poll: the other replicas' events, then the read noted."""
    assert replica.peers is not None
    assert replica.peer_sync is not None
    started = time.monotonic()
    for event in await replica.io_call(replica.peers.poll):
        invalidation.apply_peer(replica, event)
    replica.peer_sync.read(started)


def test_a_write_landing_after_a_peers_invalidation_is_deleted_when_the_event_is_read(
    server: MilvusServer,
) -> None:
    """B takes a store, A invalidates its tenant (A's delete finds nothing yet), B's write
    lands, and only then does B read A's event. The row stayed in Milvus and, once the
    tombstones expired, both replicas served it EXACT for its whole TTL."""

    async def scenario() -> None:
        text, tenant = "has my refund been processed", "race-late-write"
        async with (
            cache(server.uri, tombstone_s=STONES_S) as (_, a),
            cache(
                server.uri,
                tombstone_s=STONES_S,
                flush_interval_ms=400.0,  # the store is still pending when A deletes
                peer_poll_ms=NEVER_MS,
                peer_stale_s=NEVER_MS,
            ) as (b_service, b),
        ):
            await store(b, text, scope=scope(tenant))
            await a.Invalidate(
                cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant=tenant)), timeout=10
            )
            await written(b)  # landed after A's delete
            await poll(b_service)
            await asyncio.sleep(STONES_S + 0.5)  # B's re-delete, and every stone gone
            for replica in (a, b):
                outcome = (await lookup(replica, text, scope=scope(tenant))).outcome
                assert outcome == MISS, common_pb2.CacheOutcome.Name(outcome)

    run(scenario)


def test_a_replica_that_cannot_read_the_log_stops_answering_from_memory(
    server: MilvusServer,
) -> None:
    """Milvus stops answering (the server SIGSTOPped): B can no longer hear A's
    invalidations, so after HOPLINE_CACHE_PEER_STALE_S its index answers nothing, its watch
    streams end (a gateway's local tier goes with them) and new ones are refused; once the
    log is read again all of it comes back. Before, B and its gateways served entries A had
    invalidated for the whole outage."""
    assert server.process is not None
    group = server.process.pid

    async def scenario() -> None:
        text, tenant = "where is my parcel", "race-outage"
        async with cache(
            server.uri, peer_stale_s=0.5, milvus_timeout_s=1.0, tombstone_s=STONES_S
        ) as (_, b):
            await store(b, text, scope=scope(tenant))
            await written(b)
            assert (await lookup(b, text, scope=scope(tenant))).outcome == EXACT
            watch = b.WatchInvalidations(cache_pb2.WatchInvalidationsRequest(), timeout=60)
            assert (await watch.read()).live
            os.killpg(group, signal.SIGSTOP)
            try:
                ended = await asyncio.wait_for(watch.read(), 10)
                assert ended is grpc.aio.EOF  # type: ignore[attr-defined]  # ended (not in stubs)
                again = b.WatchInvalidations(cache_pb2.WatchInvalidationsRequest(), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await again.read()
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "cannot read the other replicas' invalidations" in str(
                    refused.value.details()
                )
                with pytest.raises(grpc.aio.AioRpcError) as unread:
                    await lookup(b, text, scope=scope(tenant))  # Milvus, which is the outage
                assert unread.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                os.killpg(group, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while True:
                try:
                    back = b.WatchInvalidations(cache_pb2.WatchInvalidationsRequest(), timeout=5)
                    if (await back.read()).live:
                        back.cancel()
                        break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline, "the watch never came back"
                    await asyncio.sleep(0.2)
            assert (await lookup(b, text, scope=scope(tenant))).outcome == EXACT

    run(scenario)
