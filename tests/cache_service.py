"""A real CacheService (real milvus-lite file, real gRPC server) in the test's own process,
so its counters and store can be looked at, and the calls the cache tests make to it; and a
real `hopline serve cache` process run to its exit (`serve_cache`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc

from harness import free_port
from hopline.cache.config import CacheConfig
from hopline.cache.service import CacheService
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2


def scope(tenant: str = "idx", model: str = "m") -> common_pb2.Scope:
    return common_pb2.Scope(
        tenant=tenant, model=model, model_version="1", parameters={"top_k": "1"}
    )


@asynccontextmanager
async def cache(db: Path | str, **config: Any) -> AsyncIterator[tuple[CacheService, Any]]:
    """A cache service on `db` (a milvus-lite file or a Milvus server's URI) on a free port."""
    async with _serve(db, config) as served:
        yield served


@asynccontextmanager
async def _serve(db: Path | str, config: dict[str, Any]) -> AsyncIterator[tuple[CacheService, Any]]:
    service = CacheService(CacheConfig(**{"uri": str(db), "flush_interval_ms": 1.0, **config}))
    server = grpc.aio.server()
    service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await service.start()
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service, cache_pb2_grpc.CacheServiceStub(channel)
    finally:
        await server.stop(None)
        await service.stop()


async def store(stub: Any, text: str, label: str = "order_status", **kw: Any) -> str:
    reply = await stub.Store(
        cache_pb2.StoreRequest(
            scope=kw.pop("scope", scope()),
            text=text,
            prediction=common_pb2.Prediction(label=label, score=0.9),
            mode=kw.pop("mode", "exact"),
            **kw,
        ),
        timeout=10,
    )
    return str(reply.entry_id)


def store_batch(tenant: str, texts: range, bound: int = 0) -> cache_pb2.StoreBatchRequest:
    """Exact stores of "<tenant> text <i>" for each i, under a bound of `bound` (0: the
    cache's own)."""
    return cache_pb2.StoreBatchRequest(
        stores=[
            cache_pb2.StoreRequest(
                scope=scope(tenant),
                text=f"{tenant} text {i}",
                prediction=common_pb2.Prediction(label="x", score=0.9),
                mode="exact",
                max_entries=bound,
            )
            for i in texts
        ]
    )


async def written(stub: Any) -> None:
    """Wait until every acknowledged store is in Milvus (and so in the index)."""
    deadline = time.monotonic() + 20
    while (await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)).pending_writes:
        assert time.monotonic() < deadline, "stores never reached Milvus"
        await asyncio.sleep(0.01)


async def lookup(stub: Any, text: str, **kw: Any) -> cache_pb2.LookupResponse:
    reply: cache_pb2.LookupResponse = await stub.Lookup(
        cache_pb2.LookupRequest(scope=kw.pop("scope", scope()), text=text, **kw), timeout=10
    )
    return reply


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def serve_cache(
    uri: str, timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> tuple[int, str, float]:
    env = dict(
        os.environ,
        **(env or {}),
        HOPLINE_CACHE_URI=uri,
        HOPLINE_CACHE_ADDR=f"127.0.0.1:{free_port()}",
        HOPLINE_LOG_FORMAT="text",
        HOPLINE_METRICS_PORT="0",  # two caches at once here: no second /metrics on one port
        HOPLINE_CACHE_MILVUS_TIMEOUT_S="3",
    )
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "hopline", "serve", "cache"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - started
