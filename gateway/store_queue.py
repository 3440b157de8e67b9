"""The gateway's cache stores, gathered into StoreBatch calls without a task per store.

A miss's answer is stored after its reply. A store used to go through the batched stages
like a request's hop (a task, a traced hop call and a queued future per store, the batch
splitting the reply back into them), which cost the gateway's event loop more per store than
the StoreBatch it shared: on 2 cores that CPU runs beside the next request's model run.
Here a store is a row appended to a list: the rows of a linger window
(HOPLINE_GATEWAY_STORE_LINGER_MS; 0: none) go in one StoreBatch, with at most `in_flight`
such calls on their way (rows that come meanwhile wait for the next), and each row's result
is counted when the reply comes.

- A row the cache refuses counts as a store error on its own. A batch refused for its content
  (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND) goes again row by row, so a bad row fails
  only itself; any other failure (UNAVAILABLE, DEADLINE_EXCEEDED) fails the batch's rows.
- A cache with no replica SERVING (one draining, still accepting for its drain delay) gets
  every row at once: lingering, they reached it after it stopped accepting.
- A cache from before StoreBatch answers UNIMPLEMENTED: `unary` stores those rows one by one
  (cache_writes.py then sends Store calls for a while).
- Traces: a request whose trace is recorded gets a `cache_store` client span from its store to
  its batch's reply, linked from the batch's span; the StoreBatch call is one hop call (its
  span and `hopline_hop_duration_seconds{hop="cache_store"}`) per batch. Unrecorded requests
  (all of them unless exporting) cost a list append.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from hopline.gateway.upstream import HopError
from hopline.observability import metrics, schema
from hopline.observability.logs import Episodes
from hopline.observability.tracing import in_context, tracer
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.runtime.errors import status_code

log = logging.getLogger("hopline.gateway")
# Stores that fail, said once an episode: with the cache away every batch fails.
STORE_FAILURES = Episodes(log, "cache store failed")
STORES = "stores"  # the episodes' one key: any store that lands ends the episode

STORE_BATCH_ROWS = 256  # stores in one StoreBatch (the cache takes up to 1024)
# Statuses about a batch's content: its rows go again one by one.
ROW_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
    }
)

# One traced StoreBatch call (raises HopError), None where the cache has no StoreBatch.
SendBatch = Callable[[cache_pb2.StoreBatchRequest], Awaitable[cache_pb2.StoreBatchResponse | None]]
Unary = Callable[[Sequence[cache_pb2.StoreRequest]], Awaitable[None]]


@dataclasses.dataclass(eq=False)
class _Row:
    request: cache_pb2.StoreRequest
    parent: trace.Span  # the request's span as it stored (unrecorded, for most)
    span: trace.Span | None  # its store span, when its trace is recorded


class StoreQueue:
    """The stores waiting for a StoreBatch call, and the calls on their way."""

    def __init__(
        self,
        send: SendBatch,
        unary: Unary,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        *,
        linger_s: float,
        in_flight: int,
        address: str,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        self._send = send
        # True while the cache has no replica SERVING (a lone one draining): its rows go now,
        # lingering none, while it still accepts them (HOPLINE_DRAIN_DELAY_S).
        self._hurry = hurry
        self._unary = unary  # rows for a cache without StoreBatch
        self._spawn = spawn
        self._linger_s = max(0.0, linger_s)
        self._in_flight = max(1, in_flight)
        self._address = address
        self._rows: list[_Row] = []
        self._due = False  # the rows go as soon as a call is free
        self._timer: asyncio.TimerHandle | None = None
        self._sending = 0

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, request: cache_pb2.StoreRequest) -> None:
        parent = trace.get_current_span()
        self._rows.append(_Row(request, parent, _store_span(parent, self._address)))
        if not self._linger_s or len(self._rows) >= STORE_BATCH_ROWS or self._hurry():
            self._due = True
        elif not self._due and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._linger_s, self._lingered)
        self._pump()

    def flush(self) -> None:
        """Every row is due now (a stopping gateway waits out no linger)."""
        self._due = True
        self._pump()

    def _lingered(self) -> None:
        self._timer = None
        self.flush()

    def _pump(self) -> None:
        while self._due and self._rows and self._sending < self._in_flight:
            rows, self._rows = self._rows[:STORE_BATCH_ROWS], self._rows[STORE_BATCH_ROWS:]
            self._sending += 1
            self._spawn(self._send_slot(rows))
        if not self._rows:
            self._due = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    async def _send_slot(self, rows: list[_Row]) -> None:
        try:
            await self._send_rows(rows)
        finally:
            self._sending -= 1
            self._pump()

    async def _send_rows(self, rows: list[_Row]) -> None:
        request = cache_pb2.StoreBatchRequest(stores=[r.request for r in rows])
        try:
            with _batch_span(rows):
                reply = await self._send(request)
        except HopError as err:
            if len(rows) > 1 and err.code in ROW_CODES:
                await asyncio.gather(*(self._send_rows([r]) for r in rows))
            else:
                _settle(rows, [(err.code, err.details)] * len(rows))
            return
        if reply is None:
            _end_spans(rows)
            await self._unary([r.request for r in rows])
            return
        if len(reply.results) != len(rows):
            details = f"{len(reply.results)} results for {len(rows)} stores"
            _settle(rows, [(grpc.StatusCode.INTERNAL, details)] * len(rows))
            return
        _settle(rows, [(status_code(r.code), r.message) for r in reply.results])


def _store_span(parent: trace.Span, address: str) -> trace.Span | None:
    """A recorded request's span for its store, from now to its batch's reply."""
    if not parent.is_recording():
        return None
    return tracer().start_span(
        schema.SPAN_CACHE_STORE,
        kind=SpanKind.CLIENT,
        attributes={
            "rpc.system": "grpc",
            "server.address": address,
            schema.HOP: schema.SPAN_CACHE_STORE,
        },
    )


def _batch_span(rows: Sequence[_Row]) -> contextlib.AbstractContextManager[object]:
    """The batch's span, in the first recorded row's trace and linked from every recorded
    row's store span; none when no row is recorded (the call then carries the first row's
    unrecorded trace, so nobody downstream records it either)."""
    spans = [r.span for r in rows if r.span is not None]
    if not spans:
        return in_context(trace.set_span_in_context(rows[0].parent))
    return tracer().start_as_current_span(
        schema.SPAN_STAGE_BATCH,
        context=trace.set_span_in_context(spans[0]),
        kind=SpanKind.INTERNAL,
        links=[Link(s.get_span_context()) for s in spans],
        attributes={schema.HOP: schema.SPAN_CACHE_STORE, schema.BATCH_SIZE: len(rows)},
    )


# The cache's answer to a store whose entry was invalidated a moment ago (cache/intake.py):
# not taken, by design, so neither an error nor a failure to log.
FENCED = grpc.StatusCode.ABORTED


def _settle(rows: Sequence[_Row], outcomes: Sequence[tuple[grpc.StatusCode, str]]) -> None:
    """Count each row's result; a failing status is logged with how many rows had it, once
    an episode (`STORE_FAILURES`)."""
    failed: collections.Counter[grpc.StatusCode] = collections.Counter()
    details: dict[grpc.StatusCode, str] = {}
    fenced = 0
    for row, (code, message) in zip(rows, outcomes, strict=True):
        if code == FENCED:
            fenced += 1
        elif code != grpc.StatusCode.OK:
            failed[code] += 1
            details.setdefault(code, message)
        if row.span is not None:
            if code not in (grpc.StatusCode.OK, FENCED):
                row.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
            row.span.end()
    if fenced:
        metrics.CACHE_STORES.labels("skipped_invalidated").inc(fenced)
    stored = len(rows) - sum(failed.values()) - fenced
    if stored:
        metrics.CACHE_STORES.labels("stored").inc(stored)
        STORE_FAILURES.ended(STORES)
    for code, count in failed.items():
        metrics.CACHE_STORES.labels("error").inc(count)
        STORE_FAILURES.failed(
            STORES, code.name, status=code.name, stores=count, details=details[code]
        )


def _end_spans(rows: Sequence[_Row]) -> None:
    for row in rows:
        if row.span is not None:
            row.span.end()
