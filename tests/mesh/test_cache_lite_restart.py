"""The cache's embedded milvus-lite server killed under it (the kernel's OOM killer, a crash):
the next calls start it again on the same file, the stores made meanwhile reach it, and a
cache started afterwards finds them all (cache/milvus_lite.py:ServerExited,
cache/milvus_connection.py). A real CacheService and milvus-lite file in this process; the
server is killed with SIGKILL, as the OOM killer does."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
from cache_service import cache, lookup, run, store, written

from hopline.cache import milvus_lite
from hopline.cache.counts import CacheCount
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

TEXTS = ("where is my parcel", "cancel my subscription", "reset my password")


def _kill_server(db: Path) -> int:
    process = milvus_lite._server_process(db)
    assert process is not None, "milvus-lite started no server"
    assert process.poll() is None, "milvus-lite's server is not running"
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    return process.pid


def test_a_killed_milvus_lite_server_is_started_again_and_no_store_is_lost(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cache.db"

    async def body() -> None:
        async with cache(db) as (service, stub):
            await store(stub, TEXTS[0])
            await written(stub)
            killed = _kill_server(db)
            for text in TEXTS[1:]:
                await store(stub, text)  # acknowledged: its write waits for Milvus
            # Without a restart every write fails on the dead server's socket, for ever.
            deadline = time.monotonic() + 60
            while True:
                try:
                    stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
                except grpc.aio.AioRpcError:  # UNAVAILABLE while the server is down
                    stats = None
                if stats is not None and not stats.pending_writes:
                    break
                assert time.monotonic() < deadline, "the stores never reached milvus-lite"
                await asyncio.sleep(0.2)
            process = milvus_lite._server_process(db)
            assert process is not None
            assert process.pid != killed
            assert service.counts[CacheCount.STORE_ERRORS] == 0
        async with cache(db) as (_, stub):  # the index rebuilt from the file
            for text in TEXTS:
                reply = await lookup(stub, text, mode="exact")
                assert reply.outcome == common_pb2.CACHE_OUTCOME_EXACT, text
            await written(stub)

    run(body)
