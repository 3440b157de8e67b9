"""The cache's circuit, opened because the cache was unreachable, probes as soon as the
gateway connects to it again; opened because the cache answered with failures, it keeps its
cool-down (gateway/cache_path.py:CachePath._cache_back).

The gateway's real CachePath, breaker and Upstream channel over a real grpc.aio server in this
process, which stands in for the cache service so that the test decides how it fails (a cache
that answers UNAVAILABLE is what a Milvus outage looks like); the whole mesh with a restarted
cache process: tests/mesh/test_cache.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from hopline.gateway.admission import Admission
from hopline.gateway.cache_path import CachePath
from hopline.gateway.call import PredictCall
from hopline.gateway.config import GatewayConfig
from hopline.gateway.exact_tier import LocalExactTier
from hopline.gateway.key_mirror import KeyMirror
from hopline.gateway.resilience import CircuitBreaker, CircuitState
from hopline.gateway.speculation import Speculation, SpeculationMode
from hopline.gateway.upstream import Upstream
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.runtime.server import NOT_READY

FAIL_OPEN = common_pb2.CACHE_OUTCOME_FAIL_OPEN
MISS = common_pb2.CACHE_OUTCOME_MISS
COOLDOWN_S = 60.0  # longer than the test: a probe before it is the reconnection's


class Cache:
    """The cache service's Lookup, nothing else (the gateway's lookup is all this sends)."""

    def __init__(self, failing: bool, delay_s: float = 0.0, starting: bool = False) -> None:
        self.failing = failing
        self.delay_s = delay_s
        self.starting = starting  # refused as a service's readiness gate refuses while loading
        self.lookups = 0

    async def Lookup(
        self, request: cache_pb2.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cache_pb2.LookupResponse:
        self.lookups += 1
        await asyncio.sleep(self.delay_s)
        if self.starting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        if self.failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the Milvus server is not answering")
        return cache_pb2.LookupResponse(outcome=MISS)


async def serve(cache: Cache, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    lookup = grpc.unary_unary_rpc_method_handler(
        cache.Lookup,
        request_deserializer=cache_pb2.LookupRequest.FromString,
        response_serializer=cache_pb2.LookupResponse.SerializeToString,
    )
    service = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
    handler = grpc.method_handlers_generic_handler(service, {"Lookup": lookup})
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def cache_path(
    port: int, budget_ms: float = 2000
) -> tuple[CachePath, CircuitBreaker, Upstream[Any]]:
    upstream: Upstream[Any] = Upstream(
        "cache_lookup", f"127.0.0.1:{port}", cache_pb2_grpc.CacheServiceStub, 1, 4 << 20
    )
    breaker = CircuitBreaker(2, COOLDOWN_S)
    path = CachePath(
        GatewayConfig(),
        upstream,
        Admission(max_in_flight=0, cache_budget_ms=budget_ms, adaptive_cache=False),
        breaker,
        LocalExactTier(100),
        KeyMirror(100),
        Speculation(SpeculationMode.OFF, 0.5),
        None,  # type: ignore[arg-type]  # CacheWrites: a lookup stores nothing
    )
    return path, breaker, upstream


async def look_up(path: CachePath, n: int) -> PredictCall:
    info = inference_pb2.ModelInfo(
        name="m", version="1", cache=inference_pb2.CachePolicy(mode="exact", ttl_s=60)
    )
    call = PredictCall.new(
        f"text {n}", info, "t", 1, common_pb2.CACHE_MODE_USE, 5.0, time.perf_counter()
    )
    assert await path.look_up(call) is None
    return call


def test_a_cache_that_answers_with_failures_keeps_the_circuits_cool_down() -> None:
    async def scenario() -> None:
        cache = Cache(failing=True)
        server, port = await serve(cache)
        path, breaker, upstream = cache_path(port)
        try:
            for n in range(2):
                assert (await look_up(path, n)).cache.outcome == FAIL_OPEN
            assert upstream.connected(try_to_connect=False)
            for n in range(5):
                skipped = await look_up(path, 10 + n)
                assert skipped.cache.outcome == FAIL_OPEN
                assert "circuit open" in skipped.cache.detail
            assert cache.lookups == 2
            assert breaker.retry_in() > COOLDOWN_S - 10
        finally:
            await upstream.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_an_unreachable_cache_is_probed_once_the_gateway_connects_again() -> None:
    async def scenario() -> None:
        server, port = await serve(Cache(failing=False))
        path, breaker, upstream = cache_path(port)
        try:
            assert (await look_up(path, 0)).cache.outcome == MISS
            await server.stop(None)
            for n in range(2):
                gone = await look_up(path, 1 + n)
                assert gone.cache.outcome == FAIL_OPEN
            assert "circuit open" in (await look_up(path, 3)).cache.detail
            back = Cache(failing=False)
            server, _ = await serve(back, port)
            deadline = time.monotonic() + 20
            n = 4
            while (answered := await look_up(path, n)).cache.outcome == FAIL_OPEN:
                assert time.monotonic() < deadline, answered.cache.detail
                assert "circuit open" in answered.cache.detail
                n += 1
                await asyncio.sleep(0.05)
            assert answered.cache.outcome == MISS
            assert back.lookups == 1
            assert breaker.retry_in() == pytest.approx(0.0)
        finally:
            await upstream.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_a_cache_reached_again_while_still_starting_is_probed_until_it_is_ready() -> None:
    """A restarted cache binds its port before it loads: the probe its reconnection let
    through was refused as not ready, counted a failure, and the circuit waited out its whole
    cool-down (5 s by default, here 60) before the next probe (a durability probe: hits came
    back 5 s after the cache served). It now probes again every STARTING_REPROBE_S."""

    async def scenario() -> None:
        server, port = await serve(Cache(failing=False))
        path, breaker, upstream = cache_path(port)
        try:
            await server.stop(None)
            for n in range(3):
                assert (await look_up(path, n)).cache.outcome == FAIL_OPEN
            back = Cache(failing=False, starting=True)
            server, _ = await serve(back, port)
            deadline = time.monotonic() + 20
            n = 10
            while back.lookups == 0:  # the reconnection's probe, refused: still loading
                assert time.monotonic() < deadline, "no probe reached the restarted cache"
                assert (await look_up(path, n)).cache.outcome == FAIL_OPEN
                n += 1
                await asyncio.sleep(0.05)
            assert breaker.retry_in() < COOLDOWN_S / 2
            back.starting = False  # loaded
            while (answered := await look_up(path, n)).cache.outcome == FAIL_OPEN:
                assert time.monotonic() < deadline, answered.cache.detail
                n += 1
                await asyncio.sleep(0.05)
            assert answered.cache.outcome == MISS
            assert state_of(breaker) == CircuitState.CLOSED
        finally:
            await upstream.close()
            await server.stop(None)

    asyncio.run(scenario())


def state_of(breaker: CircuitBreaker) -> CircuitState:
    return breaker.state  # read through a call: mypy keeps an asserted state for the next


def test_lookups_out_of_a_budget_their_deadline_cut_never_open_the_circuit() -> None:
    """A lookup's budget is cut to what its caller's deadline leaves: one client's tight
    deadlines ran its lookups out of time, each counted a cache failure, and the circuit
    opened for every tenant (a fuzzing probe). Out of more than half the budget, they still
    count."""

    async def scenario() -> None:
        server, port = await serve(Cache(failing=False, delay_s=0.3))
        path, breaker, upstream = cache_path(port, budget_ms=100)
        try:
            path.admission.lookup_budget_s = lambda call: 0.02  # type: ignore[method-assign]
            for n in range(5):
                cut = await look_up(path, n)
                assert cut.cache.outcome == FAIL_OPEN
                assert "DEADLINE" in cut.fail_open_reason.upper()
            assert state_of(breaker) == CircuitState.CLOSED
            assert not path.admission.overloaded()
            # Cut, but to more than half the budget: a cache that slow is taken for failing
            # (not counting any cut lookup left a hung cache's circuit closed for ever).
            path.admission.lookup_budget_s = lambda call: 0.07  # type: ignore[method-assign]
            for n in range(2):
                assert (await look_up(path, 10 + n)).cache.outcome == FAIL_OPEN
            assert state_of(breaker) == CircuitState.OPEN
        finally:
            await upstream.close()
            await server.stop(None)

    asyncio.run(scenario())
