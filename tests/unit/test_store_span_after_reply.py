"""A recorded request's cache store gets its `cache_store` span (gateway/store_queue.py) only
if the store starts while the request's span is still open: the queue opens a row's span
under the current span when that span is recording. The store was moved after the reply
(gateway/cache_path.py:CachePath.store_later, loop.call_soon), by which time the handler's
server span had ended, so a recorded request whose store went in a batch with others got no
`cache_store` span and its trace no StoreBatch (found by probing with Jaeger: 1 of 3 traces
had one). The store's writer is a stand-in that notes what it runs under."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from hopline.cache.keys import scope_tuple
from hopline.gateway.cache_path import CachePath
from hopline.gateway.call import PredictCall
from hopline.gateway.config import GatewayConfig
from hopline.gateway.exact_tier import LocalExactTier
from hopline.gateway.key_mirror import KeyMirror
from hopline.gateway.resilience import CircuitBreaker
from hopline.observability import metrics, tracing
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2


class Writes:
    """CacheWrites' store: notes whether the span current when it runs is recording, and
    whether the handler had returned by then."""

    def __init__(self) -> None:
        self.returned = False
        self.seen: list[tuple[bool, bool]] = []

    def store(self, call: PredictCall, prediction: common_pb2.Prediction) -> None:
        self.seen.append((trace.get_current_span().is_recording(), self.returned))


def cache_path(writes: Writes, breaker: CircuitBreaker) -> CachePath:
    return CachePath(
        GatewayConfig(),
        None,  # type: ignore[arg-type]  # store_later sends nothing itself
        None,  # type: ignore[arg-type]
        breaker,
        LocalExactTier(100),
        KeyMirror(100),
        None,  # type: ignore[arg-type]
        writes,  # type: ignore[arg-type]
    )


def a_call() -> PredictCall:
    scope = common_pb2.Scope(tenant="t", model="m", model_version="1")
    return PredictCall(
        text="where is my order",
        info=inference_pb2.ModelInfo(
            name="m", version="1", cache=inference_pb2.CachePolicy(ttl_s=60)
        ),
        top_k=1,
        mode=common_pb2.CACHE_MODE_USE,
        timeout_s=1.0,
        started=time.perf_counter(),
        scope=scope,
        scope_key=scope_tuple(scope),
        key="ab12" * 16,
        response=gateway_pb2.PredictResponse(),
    )


def stored_under(span_of_request: Any) -> list[tuple[bool, bool]]:
    writes = Writes()
    path, call = cache_path(writes, CircuitBreaker(3, 1.0)), a_call()

    async def handler_then_reply() -> None:
        with span_of_request():
            path.store_later(call, common_pb2.Prediction(label="order_status", score=0.9))
        writes.returned = True  # and its span ended; the loop turns to the store
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(handler_then_reply())
    return writes.seen


def test_a_recorded_requests_store_starts_under_its_open_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = TracerProvider()
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    [(recording, _)] = stored_under(
        lambda: provider.get_tracer("t").start_as_current_span("predict")
    )
    assert recording


def test_an_unrecorded_requests_store_still_waits_for_the_reply() -> None:
    """The common case (traces not recorded) keeps the store off the reply's path."""
    unrecorded = NonRecordingSpan(SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(0)))
    assert stored_under(lambda: tracing.in_context(set_span_in_context(unrecorded))) == [
        (False, True)
    ]


def test_an_answer_not_stored_while_the_circuit_is_open_is_counted() -> None:
    """The answers given while the cache's circuit is open are written nowhere: counted as
    such (an SRE's probe: 193 of 197 answers during a cache restart were in no count)."""
    writes, breaker = Writes(), CircuitBreaker(1, 60.0)
    breaker.failure()
    before = metrics.count(metrics.CACHE_STORES, result="skipped_circuit_open")
    cache_path(writes, breaker).store_later(a_call(), common_pb2.Prediction(label="x", score=0.9))
    assert writes.seen == []
    assert metrics.count(metrics.CACHE_STORES, result="skipped_circuit_open") == before + 1
