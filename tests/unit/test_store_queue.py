"""The gateway's cache stores (hopline.gateway.store_queue): rows linger into one StoreBatch,
each row's result counts on its own, and recorded requests keep a store span each.

The cache here is a stand-in StoreBatch method that records its calls and refuses rows the
way the real cache does (a per-row code in the reply); the real cache answers them in
tests/mesh/test_cache_store_batch.py, and a whole gateway's in tests/unit/test_gateway_cache_path.py
and tests/mesh/test_colocation.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from hopline.gateway import store_queue
from hopline.gateway.store_queue import StoreQueue
from hopline.gateway.upstream import HopError
from hopline.observability import metrics, tracing
from hopline.protos.hopline.cache.v1 import cache_pb2


class Cache:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.unary: list[list[str]] = []
        self.refuse = "bad"  # a row whose text has this is refused on its own
        self.batch_error: grpc.StatusCode | None = None  # the whole call fails with it
        self.has_store_batch = True

    async def StoreBatch(
        self, request: cache_pb2.StoreBatchRequest
    ) -> cache_pb2.StoreBatchResponse | None:
        texts = [s.text for s in request.stores]
        self.calls.append(texts)
        if not self.has_store_batch:
            return None
        if self.batch_error is not None and len(texts) > 1:
            raise HopError("cache_store", self.batch_error, "refused as a batch")
        return cache_pb2.StoreBatchResponse(
            results=[
                cache_pb2.StoreResult(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0] if self.refuse in t else 0,
                    message="refused" if self.refuse in t else "",
                )
                for t in texts
            ]
        )

    async def Store(self, requests: Any) -> None:
        self.unary.append([r.text for r in requests])


class Queue:
    """A StoreQueue over `Cache`, with its tasks kept to be awaited."""

    def __init__(self, cache: Cache, linger_s: float, hurry: bool = False) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.hurry = hurry
        self.queue = StoreQueue(
            cache.StoreBatch,
            cache.Store,
            self._spawn,
            linger_s=linger_s,
            in_flight=1,
            address="cache:8023",
            hurry=lambda: self.hurry,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def put(self, *texts: str) -> None:
        for text in texts:
            self.queue.put(cache_pb2.StoreRequest(text=text))

    async def settle(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks)


def stores() -> dict[str, float]:
    return {
        result: metrics.count(metrics.CACHE_STORES, result=result) for result in ("stored", "error")
    }


def changed(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in stores().items()}


def test_stores_linger_into_one_batch_a_full_one_goes_at_once_and_flush_sends_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_queue, "STORE_BATCH_ROWS", 3)

    async def scenario() -> None:
        cache = Cache()
        q = Queue(cache, linger_s=0.05)
        q.put("alone")
        await asyncio.sleep(0.01)
        assert cache.calls == []
        assert len(q.queue) == 1
        await asyncio.sleep(0.06)
        await q.settle()
        assert cache.calls == [["alone"]]
        q.put("a", "b", "c", "d")  # three fill a batch: sent without waiting
        await asyncio.sleep(0)
        assert cache.calls[1:] == [["a", "b", "c"]]
        q.queue.flush()  # as a stopping gateway does
        await asyncio.wait_for(q.settle(), 0.03)  # before the linger
        assert cache.calls[2:] == [["d"]]

    asyncio.run(scenario())


def test_rows_linger_none_while_the_cache_has_no_replica_serving() -> None:
    """A lone cache draining says NOT_SERVING and accepts for its drain delay only: rows left
    to linger reached it after it stopped accepting (an operator's probe)."""

    async def scenario() -> None:
        cache = Cache()
        q = Queue(cache, linger_s=10.0)
        q.put("lingers")
        await asyncio.sleep(0.01)
        assert cache.calls == []
        q.hurry = True  # the cache's one replica says NOT_SERVING
        q.put("now")
        await asyncio.wait_for(q.settle(), 1.0)
        assert cache.calls == [["lingers", "now"]]

    asyncio.run(scenario())


def test_without_a_linger_one_goes_at_once_and_the_rest_wait_for_it_together() -> None:
    async def scenario() -> None:
        cache = Cache()
        q = Queue(cache, linger_s=0.0)
        q.put("first", "second", "third")
        await q.settle()
        assert cache.calls == [["first"], ["second", "third"]]

    asyncio.run(scenario())


def test_a_refused_row_fails_alone_and_each_row_counts() -> None:
    async def scenario() -> None:
        cache = Cache()
        q = Queue(cache, linger_s=0.01)
        before = stores()
        q.put("one", "bad one", "two")
        await asyncio.sleep(0.02)
        await q.settle()
        assert cache.calls == [["one", "bad one", "two"]]
        assert changed(before) == {"stored": 2, "error": 1}

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("code", "calls", "counts"),
    [
        # About its content: each row again on its own, so the bad one fails alone.
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            [["one", "bad one"], ["one"], ["bad one"]],
            {"stored": 1, "error": 1},
        ),
        # The cache itself: every row of the batch fails, nothing is retried row by row.
        (grpc.StatusCode.UNAVAILABLE, [["one", "bad one"]], {"stored": 0, "error": 2}),
    ],
)
def test_a_failed_batch(
    code: grpc.StatusCode, calls: list[list[str]], counts: dict[str, float]
) -> None:
    async def scenario() -> None:
        cache = Cache()
        cache.batch_error = code
        q = Queue(cache, linger_s=0.01)
        before = stores()
        q.put("one", "bad one")
        await asyncio.sleep(0.02)
        await q.settle()
        assert cache.calls == calls
        assert changed(before) == counts

    asyncio.run(scenario())


def test_a_cache_without_store_batch_gets_the_rows_one_by_one() -> None:
    async def scenario() -> None:
        cache = Cache()
        cache.has_store_batch = False
        q = Queue(cache, linger_s=0.01)
        q.put("one", "two")
        await asyncio.sleep(0.02)
        await q.settle()
        assert cache.unary == [["one", "two"]]

    asyncio.run(scenario())


def test_a_recorded_request_gets_a_store_span_linked_from_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only recorded requests pay for spans: an unrecorded one's store opens none, and a
    batch of unrecorded rows opens none either."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    client = provider.get_tracer("test")
    unrecorded = NonRecordingSpan(
        SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(0))
    )

    async def scenario() -> None:
        cache = Cache()
        q = Queue(cache, linger_s=0.01)
        with client.start_as_current_span("predict"):
            q.put("recorded")
        with tracing.in_context(set_span_in_context(unrecorded)):
            q.put("unrecorded")
        await asyncio.sleep(0.02)
        await q.settle()
        with tracing.in_context(set_span_in_context(unrecorded)):
            q.put("alone unrecorded")
        await asyncio.sleep(0.02)
        await q.settle()
        assert cache.calls == [["recorded", "unrecorded"], ["alone unrecorded"]]

    asyncio.run(scenario())
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["cache_store", "gateway.stage_batch", "predict"]
    by_name = {s.name: s for s in spans}
    store, batch, predict = (
        by_name["cache_store"],
        by_name["gateway.stage_batch"],
        by_name["predict"],
    )
    assert store.parent is not None
    assert store.parent.span_id == predict.context.span_id
    assert [link.context.span_id for link in batch.links] == [store.context.span_id]
    assert batch.attributes is not None
    assert batch.attributes["hopline.batch_size"] == 2
    assert store.end_time is not None
    assert batch.end_time is not None
    assert store.end_time >= batch.end_time  # open until its batch's reply
