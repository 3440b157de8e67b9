"""Gateway batching: misses waiting for the same stage at the same moment share one RPC.

Each stage (tokenize, inference, postprocess) keeps at most `in_flight` RPCs on their way
per batch key (model, version, and for postprocess top_k) for each replica its address names:
with one slot for two inference replicas, every miss queued behind the RPC the slower one
held (300 ms added to one of two: the inference hop's p50 from 57 to 320 ms, the other
replica idle; a network-fault probe), and the two never ran at once. A request that finds
a free slot is sent at once, alone: a lone request waits for nothing. Requests that arrive
while every slot is taken queue, and go together, up to `max_rows`, in the RPC that the next
free slot sends (a lone request is sent from its caller's task: no task, future or shield of
its own). The
queue is in fair order (runtime/fairness.py): while several tenants' rows wait, each gets an
equal share of the rows sent, so a flood does not queue the others behind all of its own.
So under load the per-RPC cost (serialisation, a round trip, a server's per-call work) is paid
per batch, and at rest nothing changes. The cache stores after a reply are batched apart
(gateway/store_queue.py): nobody waits for them, so they linger for each other.

Each request keeps its own hop span and timing (gateway/upstream.py:call_hop calls
`BatchedStage` like a stub method), the batch RPC gets a span of its own linked to every
request's, and the upstream's server span is the batch span's child. A batch that fails
with a status about its content (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED) is sent
again row by row, so a bad row fails only its own request; a failure of the upstream itself
(UNAVAILABLE, DEADLINE_EXCEEDED, ...) reaches every row, as it would have one by one.

How a stage's rows become one request and its reply theirs again: gateway/stage_codecs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from hopline.gateway.addresses import one_endpoint
from hopline.gateway.hedging import Hedging
from hopline.gateway.stage_codecs import Codec, InferCodec, PostprocessCodec, TokenizeCodec
from hopline.gateway.upstream import CoLocated, GatewayUpstreams, Pool, Upstream
from hopline.observability import metrics, schema
from hopline.observability.tracing import in_context, outgoing_metadata, tracer, unsampled
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2
from hopline.runtime.fairness import FLOW, FairQueue

log = logging.getLogger("hopline.gateway.stage_batching")

Req = TypeVar("Req")
Rep = TypeVar("Rep")

# Statuses that can be about one row's content: the batch is retried row by row.
ROW_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


@dataclasses.dataclass
class _Row(Generic[Req, Rep]):
    request: Req
    deadline: float  # monotonic
    metadata: tuple[tuple[str, str | bytes], ...]
    reply: asyncio.Future[Rep]
    # The caller's trace context (its hop span), which `metadata` carries as traceparent:
    # kept as is for the batch span, not parsed back out of the metadata per row.
    context: otel_context.Context


class BatchedStage(Generic[Req, Rep]):
    """Called like a grpc.aio stub method; sends rows together when the stage is busy."""

    def __init__(
        self,
        hop: str,
        send: Callable[[], Callable[..., Awaitable[Rep]]],
        codec: Codec[Req, Rep],
        in_flight: int,
        max_rows: Callable[[Req], int],
        company: Callable[[], bool] | None = None,
        linger_s: float = 0.0,
        hedging: Hedging[Rep] | None = None,
        replicas: Callable[[], int] | None = None,
    ) -> None:
        """`replicas()`: how many servers the upstream names now; `in_flight` slots each."""
        self.hop = hop
        self._replicas = replicas
        # With `company`, a request that finds a free slot while company() says other requests
        # are in the gateway waits up to `linger_s` (0: one turn of the event loop) for those
        # that reach the stage meanwhile (GatewayStages.over says why).
        self._company = company
        self._linger_s = linger_s
        self._gathering: dict[Hashable, asyncio.Handle] = {}
        # The next stub method (a pool picks the channel per call), or the hedging over it.
        self._hedging = hedging
        self._send = send if hedging is None else lambda: hedging
        self._codec = codec
        self._in_flight = max(1, in_flight)
        self._max_rows = max_rows
        self._busy: dict[Hashable, int] = {}
        # Per key, in fair order between tenants (runtime/fairness.py): a tenant's flood
        # does not queue the others' rows behind all of its own.
        self._queues: dict[Hashable, FairQueue[_Row[Req, Rep]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(
        self,
        request: Req,
        *,
        timeout: float,  # noqa: ASYNC109 (a stub's signature: the call's deadline)
        metadata: Sequence[tuple[str, str | bytes]] = (),
        **_: Any,
    ) -> Rep:
        key = self._codec.key(request)
        free = key not in self._queues and self._busy.get(key, 0) < self._slots()
        if free and not self._gathers(request):
            return await self._send_alone(key, request, timeout, tuple(metadata))
        row: _Row[Req, Rep] = _Row(
            request,
            time.monotonic() + timeout,
            tuple(metadata),
            asyncio.get_running_loop().create_future(),
            otel_context.get_current(),
        )
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = FairQueue()
        queue.push(row, FLOW.get())
        if free:
            self._gather(key)
        elif key in self._gathering and len(queue) >= self._max_rows(queue.head().request):
            self._gathered(key)  # a full batch waits for nobody
        self._pump(key)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(row.reply)
        except TimeoutError:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            row.reply.cancel()  # given up (or answered: then a no-op): not sent if still queued

    async def _send_alone(
        self,
        key: Hashable,
        request: Req,
        budget_s: float,
        metadata: tuple[tuple[str, str | bytes], ...],
    ) -> Rep:
        """A free slot and nobody queued: the request goes now, from the caller's task (no
        task, future or shield of its own), as `_send_rows` would have sent it alone."""
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            return await self._call(request, budget_s, metadata)
        finally:
            self.release(key)

    def _slots(self) -> int:
        return self._in_flight * (1 if self._replicas is None else self._replicas())

    def release(self, key: Hashable) -> None:
        """A call that held a slot of `key` ended: the rows queued meanwhile may go."""
        self._busy[key] -= 1
        if self._busy[key] == 0:
            del self._busy[key]
        self._pump(key)

    def _gathers(self, request: Req) -> bool:
        """Whether a request that found the slot free waits for company: only while there is
        some, and only where a batch can hold more than this request."""
        return self._company is not None and self._max_rows(request) > 1 and self._company()

    def _gather(self, key: Hashable) -> None:
        loop = asyncio.get_running_loop()
        self._gathering[key] = (
            loop.call_later(self._linger_s, self._gathered, key)
            if self._linger_s > 0
            else loop.call_soon(self._gathered, key)
        )

    def _gathered(self, key: Hashable) -> None:
        handle = self._gathering.pop(key, None)
        if handle is not None:
            handle.cancel()  # when the batch filled up first
        self._pump(key)

    def _pump(self, key: Hashable) -> None:
        """Send what is queued for `key` while it has free slots."""
        if key in self._gathering:
            return
        queue = self._queues.get(key)
        slots = self._slots()
        while queue and self._busy.get(key, 0) < slots:
            queue.prune(lambda r: r.reply.done())  # a waiter may have given up
            if not queue:
                break
            limit = max(1, self._max_rows(queue.head().request))
            rows = [queue.pop() for _ in range(min(limit, len(queue)))]
            self._busy[key] = self._busy.get(key, 0) + 1
            if len(rows) > 1:
                model = key[0] if isinstance(key, tuple) else key
                metrics.BATCH_SIZE.labels(f"gateway.{self.hop}", str(model)).observe(len(rows))
            task = asyncio.create_task(self._run(key, rows))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not queue:
            self._queues.pop(key, None)

    async def _run(self, key: Hashable, rows: list[_Row[Req, Rep]]) -> None:
        try:
            await self._send_rows(rows)
        finally:
            self.release(key)

    async def _send_rows(self, rows: list[_Row[Req, Rep]]) -> None:
        timeout = max(r.deadline for r in rows) - time.monotonic()
        if len(rows) == 1:  # alone: the request goes as it came, under its own span
            await _settle(rows, self._call(rows[0].request, timeout, rows[0].metadata))
            return
        with _batch_span(self.hop, [r.context for r in rows]):
            parts = await self._batch_parts(rows, timeout)
        if parts is None:  # a row's content may be at fault: each goes again alone
            await asyncio.gather(*(self._send_rows([r]) for r in rows))
            return
        for row, part in zip(rows, parts, strict=False):  # [] after _fail
            if not row.reply.done():
                row.reply.set_result(part)

    async def _batch_parts(self, rows: list[_Row[Req, Rep]], budget_s: float) -> list[Rep] | None:
        """Each row's part of one batched reply; None when the batch must go row by row."""
        requests = [r.request for r in rows]
        try:
            merged = self._codec.merge(requests)
        except ValueError:  # rows that do not stack (shapes, dtypes): the upstream says which
            return None
        try:
            reply = await self._call(merged, budget_s, outgoing_metadata())
        except grpc.aio.AioRpcError as err:
            if err.code() in ROW_CODES:
                return None
            _fail(rows, err)  # the upstream's own failure: every row would have met it
            return []
        try:
            return self._codec.split(requests, reply)
        except ValueError:
            return None

    async def _call(
        self, request: Req, budget_s: float, metadata: Sequence[tuple[str, str | bytes]]
    ) -> Rep:
        """The stub call; anything it raises that is not a status becomes the UNKNOWN a
        remote caller would have got."""
        if budget_s <= 0:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            return await self._send()(request, timeout=budget_s, metadata=tuple(metadata))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("stage call raised")
            raise _rpc_error(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        if self._hedging is not None:
            self._hedging.close()
        for handle in self._gathering.values():
            handle.cancel()
        self._gathering.clear()
        for task in list(self._tasks):
            task.cancel()


def _batch_span(
    hop: str, contexts: list[otel_context.Context]
) -> contextlib.AbstractContextManager[trace.Span]:
    """The batch RPC's span: in the first recorded request's trace, linked from every
    request's; none when no request's trace is recorded (the call then carries the first
    request's trace id)."""
    spans = [trace.get_current_span(c).get_span_context() for c in contexts]
    recorded = [c for c, s in zip(contexts, spans, strict=True) if not unsampled(s)]
    if not recorded:
        return in_context(contexts[0])
    return tracer().start_as_current_span(
        schema.SPAN_STAGE_BATCH,
        context=recorded[0],
        kind=SpanKind.INTERNAL,
        links=[Link(s) for s in spans],
        attributes={schema.HOP: hop, schema.BATCH_SIZE: len(contexts)},
    )


async def _settle(rows: Sequence[_Row[Req, Rep]], call: Awaitable[Rep]) -> None:
    try:
        reply = await call
    except grpc.aio.AioRpcError as err:  # BatchedStage._call made any failure a status
        _fail(rows, err)
        return
    for row in rows:
        if not row.reply.done():
            row.reply.set_result(reply)


def _fail(rows: Sequence[_Row[Any, Any]], err: grpc.aio.AioRpcError) -> None:
    for row in rows:
        if not row.reply.done():
            row.reply.set_exception(err)
            row.reply.exception()  # retrieved: a waiter that gave up must not warn


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


@dataclasses.dataclass(frozen=True)
class GatewayStages:
    """The batched stages over the gateway's upstream pools: the three a miss goes through.
    None for a co-located service's stage: each request calls it alone (`over` says why)."""

    tokenize: BatchedStage[tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse] | None
    infer: BatchedStage[inference_pb2.InferRequest, inference_pb2.InferResponse] | None
    postprocess: (
        BatchedStage[postprocess_pb2.PostprocessRequest, postprocess_pb2.PostprocessResponse] | None
    )

    @classmethod
    def over(
        cls,
        upstreams: GatewayUpstreams,
        in_flight: int,
        max_rows: int,
        model_rows: Callable[[str, str], int],
        company: Callable[[], bool] | None = None,
        linger_s: float = 0.0,
        hedge_attempts: int = 1,
        hedge_min_s: float = 0.1,
    ) -> GatewayStages:
        """`model_rows(model, version)`: the most rows the model takes in one run (0: unknown).

        `company()`: whether other requests are in the gateway now. Given, a stage gathers
        while it says so: the first request to find its slot free waits up to `linger_s` (0:
        one loop turn) and the requests that reach the stage meanwhile go in its RPC, up to a
        full batch; a lone request still goes at once. Under load misses reach a stage a few
        at a time (the replies of one batch release their callers together, and their next
        requests trickle in), so without it the first of each burst went alone ahead of the
        rest. The figures are in README.md's settings table (HOPLINE_GATEWAY_BATCH_LINGER_MS).

        A co-located service's stage is not batched here: its call is a function call with
        no RPC to share, the tokenizer and postprocessing answer without yielding (a second
        call never finds the first on its way), and the inference service's dynamic batcher
        merges its own queue, from numpy arrays, where this stage merged and split tensors in
        messages. Against keeping as many calls on their way as the service has run slots and
        merging the rest, co-located, alternated pairs (docs/performance.md, "Co-located
        stages unbatched"): c=32 misses 380.6 -> 406.6 and 387.5 -> 402.4 rps (higher in 10
        of 10), open loop at 280 rps p99 61.4 -> 50.1 ms (lower in 6 of 6).
        """

        def batched(
            hop: str,
            pool: Pool[Any],
            rpc: str,
            codec: Codec[Req, Rep],
            max_rows_of: Callable[[Req], int],
        ) -> BatchedStage[Req, Rep] | None:
            if isinstance(pool, CoLocated):
                return None

            def send() -> Callable[..., Awaitable[Rep]]:
                return getattr(pool.stub(), rpc)  # type: ignore[no-any-return]

            def replicas() -> list[tuple[str, Callable[..., Any]]]:
                assert isinstance(pool, Upstream)
                return [(a, getattr(stub, rpc)) for a, stub in pool.replica_stubs()]

            hedging = None
            if hedge_attempts > 1 and not one_endpoint(pool.target):
                per_replica = replicas if isinstance(pool, Upstream) else None
                hedging = Hedging[Rep](hop, send, hedge_attempts, hedge_min_s, per_replica)
            count = pool.replica_count if isinstance(pool, Upstream) else None
            return BatchedStage(
                hop, send, codec, in_flight, max_rows_of, company, linger_s, hedging, count
            )

        def infer_rows(request: inference_pb2.InferRequest) -> int:
            return min(max_rows, model_rows(request.model, request.model_version) or max_rows)

        return cls(
            tokenize=batched(
                schema.SPAN_TOKENIZE,
                upstreams.tokenizer,
                "Tokenize",
                TokenizeCodec(),
                lambda _: max_rows,
            ),
            infer=batched(
                schema.SPAN_INFERENCE,
                upstreams.inference,
                "Infer",
                InferCodec(),
                infer_rows,
            ),
            postprocess=batched(
                schema.SPAN_POSTPROCESS,
                upstreams.postprocess,
                "Postprocess",
                PostprocessCodec(),
                lambda _: max_rows,
            ),
        )

    async def close(self) -> None:
        for stage in (self.tokenize, self.infer, self.postprocess):
            if stage is not None:
                await stage.close()
