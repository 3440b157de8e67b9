"""hopline.cache.v1.CacheService on grpc.aio."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque

import grpc
import numpy as np

from hopline.cache.keys import ScopeError, exact_key, normalise_text, scope_tuple
from hopline.cache.store import CacheStore, Entry, MemoryStore, ScopeFilter
from hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.common.v1 import common_pb2
from hopline.config import DEFAULT_ADDRS, ServerConfig, env_field

log = logging.getLogger("hopline.cache")


@dataclasses.dataclass(frozen=True)
class CacheConfig(ServerConfig):
    listen: str = env_field("HOPLINE_CACHE_ADDR", DEFAULT_ADDRS["cache"], "address to bind")
    max_entries: int = env_field("HOPLINE_CACHE_MAX_ENTRIES", 100_000, "entries before eviction")
    default_ttl_s: float = env_field(
        "HOPLINE_CACHE_TTL_S", 3600.0, "time to live when a store names none"
    )
    sweep_interval_s: float = env_field(
        "HOPLINE_CACHE_SWEEP_S", 30.0, "how often expired entries are dropped"
    )


class CacheService(cache_pb2_grpc.CacheServiceServicer):
    service_name = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name

    def __init__(self, config: CacheConfig, store: CacheStore | None = None) -> None:
        self.config = config
        self.store: CacheStore = store or MemoryStore(config.max_entries)
        self.counters = {
            "lookups": 0,
            "exact_hits": 0,
            "stores": 0,
            "evictions": 0,
            "expirations": 0,
        }
        self.lookup_ms: deque[float] = deque(maxlen=10_000)
        self._sweeper: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> None:
        cache_pb2_grpc.add_CacheServiceServicer_to_server(self, server)

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.counters["expirations"] += self.store.expire(time.time())

    async def Lookup(
        self,
        request: cache_pb2.LookupRequest,
        context: grpc.aio.ServicerContext[cache_pb2.LookupRequest, cache_pb2.LookupResponse],
    ) -> cache_pb2.LookupResponse:
        started = time.perf_counter()
        try:
            scope = scope_tuple(request.scope)
        except ScopeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        now = time.time()
        entry = self.store.get(exact_key(scope, request.text), now)
        self.counters["lookups"] += 1
        response = cache_pb2.LookupResponse(outcome=common_pb2.CACHE_OUTCOME_MISS)
        if entry is not None:
            self.counters["exact_hits"] += 1
            response.outcome = common_pb2.CACHE_OUTCOME_EXACT
            response.prediction.ParseFromString(entry.response)
            response.similarity = 1.0
            response.entry_id = entry.key
            response.age_s = now - entry.created_at
        self.lookup_ms.append((time.perf_counter() - started) * 1e3)
        return response

    async def Store(
        self,
        request: cache_pb2.StoreRequest,
        context: grpc.aio.ServicerContext[cache_pb2.StoreRequest, cache_pb2.StoreResponse],
    ) -> cache_pb2.StoreResponse:
        try:
            scope = scope_tuple(request.scope)
        except ScopeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.text:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
        if request.ttl_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ttl_s must not be negative")
        now = time.time()
        key = exact_key(scope, request.text)
        evicted = self.store.put(
            Entry(
                key=key,
                scope=scope,
                text=normalise_text(request.text),
                response=request.prediction.SerializeToString(),
                created_at=now,
                expires_at=now + (request.ttl_s or self.config.default_ttl_s),
            )
        )
        self.counters["stores"] += 1
        self.counters["evictions"] += evicted
        return cache_pb2.StoreResponse(entry_id=key)

    async def Invalidate(
        self,
        request: cache_pb2.InvalidateRequest,
        context: grpc.aio.ServicerContext[
            cache_pb2.InvalidateRequest, cache_pb2.InvalidateResponse
        ],
    ) -> cache_pb2.InvalidateResponse:
        scope = None
        if request.HasField("scope"):
            s = request.scope
            scope = ScopeFilter(s.tenant, s.model, s.model_version)
            if scope == ScopeFilter():
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "an empty scope would drop every tenant's entries; name a tenant or model",
                )
        if scope is None and not request.entry_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a scope or entry_ids")
        removed = self.store.invalidate(scope, list(request.entry_ids))
        return cache_pb2.InvalidateResponse(removed=removed)

    async def GetStats(
        self,
        request: cache_pb2.GetStatsRequest,
        context: grpc.aio.ServicerContext[cache_pb2.GetStatsRequest, cache_pb2.GetStatsResponse],
    ) -> cache_pb2.GetStatsResponse:
        times = np.array(self.lookup_ms or [0.0])
        return cache_pb2.GetStatsResponse(
            entries=len(self.store),
            lookups=self.counters["lookups"],
            exact_hits=self.counters["exact_hits"],
            semantic_hits=0,
            stores=self.counters["stores"],
            evictions=self.counters["evictions"],
            expirations=self.counters["expirations"],
            lookup_mean_ms=float(times.mean()),
            lookup_p99_ms=float(np.percentile(times, 99)),
        )
