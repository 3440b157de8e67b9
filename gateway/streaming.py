"""PredictStream: many Predicts over one bidirectional stream.

Requests are answered concurrently, up to `HOPLINE_STREAM_MAX_IN_FLIGHT` per stream (and no
more than `HOPLINE_GATEWAY_TENANT_MIN_IN_FLIGHT` once a second tenant has sent), counting
a request from when it is read until its response has been handed to gRPC; past that the
gateway stops reading, so HTTP/2 flow control pushes back on the client instead of the gateway
buffering without bound. A client that sends but does not read its responses is held the same
way: the responses it leaves unread hold their slots (before, a slot was freed once its
response was queued, and a client that never read grew the gateway's memory with every
request it sent). Responses go out as they complete, each carrying its
request's id. A request that fails gets a response with its status code and message; only a
broken stream (cancelled, deadline passed) ends the RPC.

A drain (SIGTERM, once the drain delay is over: GatewayService.drain) stops reading every
stream: what was read is answered, then the stream ends UNAVAILABLE, so a client sends the
requests it has no answer for to another replica. Before, a stream kept taking new requests
through the whole grace period and was then cut off with the answers in flight.

Tracing: the stream's server span (the interceptor's) is the parent of one
`gateway.stream_message` span per request, under which that request's hops hang, so one
stream is one trace and each request in it is a subtree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from hopline.gateway.turns import Turns
from hopline.observability import metrics, schema
from hopline.observability.tracing import child_span, current_trace_id, server_failed
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime.errors import StatusError
from hopline.runtime.interceptors import Undecodable

if TYPE_CHECKING:
    from hopline.gateway.service import GatewayService

log = logging.getLogger("hopline.gateway.stream")
M = TypeVar("M")  # a stream's request message
R = TypeVar("R")  # its reply

# An id is echoed in its reply, put on its span and in logs: one near the message size limit
# made its reply too large to send, and gRPC ended the whole stream RESOURCE_EXHAUSTED.
MAX_ID_BYTES = 4096
_END = object()
_DRAINED = object()
PREDICT_STREAM, MODEL_STREAM_INFER = "PredictStream", "ModelStreamInfer"  # metrics' method
DRAINED = (
    "shutting down: every request this stream answered is answered; send those it did not "
    "(none was read) to another replica"
)


async def predict_stream(
    gateway: GatewayService,
    requests: AsyncIterator[gateway_pb2.PredictStreamRequest],
    context: grpc.aio.ServicerContext[Any, Any],
) -> AsyncIterator[gateway_pb2.PredictStreamResponse]:
    metadata = tuple(context.invocation_metadata() or ())

    async def answer(
        message: gateway_pb2.PredictStreamRequest,
    ) -> gateway_pb2.PredictStreamResponse:
        if len(message.id) > MAX_ID_BYTES // 4 and len(message.id.encode()) > MAX_ID_BYTES:
            message_answered(PREDICT_STREAM, grpc.StatusCode.INVALID_ARGUMENT)
            return _id_too_long(message.id)
        with stream_message_span(message.id) as span:
            reply = gateway_pb2.PredictStreamResponse(id=message.id, trace_id=current_trace_id())
            try:
                reply.response.CopyFrom(
                    await gateway.answer(message.request, metadata, gateway.timeout_for(context))
                )
            except Exception as exc:  # one request's failure, or bug, must not end the others
                failed = message_failed(span, exc, message.id, PREDICT_STREAM)
                reply.code, reply.message = failed.code.value[0], failed.message
            else:
                message_answered(PREDICT_STREAM)
            return reply

    async for reply in serve_stream(gateway, requests, context, PREDICT_STREAM, answer):
        yield reply


@contextlib.contextmanager
def stream_message_span(rid: str) -> Iterator[trace.Span]:
    """A stream message's span: the request's hops hang under it."""
    with child_span(
        schema.SPAN_STREAM_MESSAGE, attributes={schema.STREAM_MESSAGE_ID: rid}, quiet=True
    ) as span:
        yield span


def message_answered(method: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> None:
    """Counts one stream message's reply by its status (`hopline_stream_messages_total`): the
    stream's own RPC ends OK whatever its messages' replies say, so without this a failing
    message was in no metric (an SRE's probe: 7 of 10 failed, an error ratio of 0)."""
    metrics.stream_messages(method, code.name).inc()


def message_failed(span: trace.Span, exc: Exception, rid: str, method: str) -> StatusError:
    """One stream message's failure as the status its reply carries, on its span and counted;
    a bug (anything not a StatusError) is logged and answered INTERNAL."""
    if isinstance(exc, StatusError):
        span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
        if server_failed(exc.code):
            span.set_status(Status(StatusCode.ERROR, exc.code.name))
        message_answered(method, exc.code)
        return exc
    log.exception("stream request failed", extra={"id": rid}, exc_info=exc)
    span.set_status(Status(StatusCode.ERROR, "INTERNAL"))
    message_answered(method, grpc.StatusCode.INTERNAL)
    return StatusError(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


async def serve_stream(
    gateway: GatewayService,
    requests: AsyncIterator[M],
    context: grpc.aio.ServicerContext[Any, Any],
    method: str,
    answer: Callable[[M], Awaitable[R]],
    texts_of: Callable[[M], int] | None = None,
) -> AsyncIterator[R]:
    """A bidirectional stream of requests each answered by `answer` (which turns a failure
    into its reply): the caller's key and a place among the gateway's open streams first
    (HOPLINE_GATEWAY_MAX_STREAMS), then up to HOPLINE_STREAM_MAX_IN_FLIGHT answered at once,
    replies in the order they complete, and the drain described above. `texts_of`: how many
    texts a request carries (a ModelStreamInfer batch), read only while the texts being
    answered leave room for its own (`Admission.stream_width`)."""
    metadata = tuple(context.invocation_metadata() or ())
    try:
        # A caller without a valid key is refused the stream itself, not each message: it
        # would otherwise hold a stream, and its memory, open as long as it liked.
        gateway.tenants.require_key(metadata)
        tenant = gateway.tenants.resolve("", metadata)
        gateway.streams.open(tenant)  # before a message is read: HOPLINE_GATEWAY_MAX_STREAMS
    except StatusError as err:
        await context.abort(err.code, err.message)
    # Nothing awaits from here to the `try` that closes the stream's place at the end.
    replies: asyncio.Queue[Any] = asyncio.Queue()
    # No more than the places its tenant is always left (as a ModelInfer batch's texts), so
    # its own requests are never refused by the tenant's share: beside nine tenants sending,
    # a stream's requests past 32 of its 64 were (a test run's, tritonclient's aio stream).
    # Read at each request: the stream may have opened while its tenant was alone.
    admission, limit = gateway.admission, gateway.config.stream_max_in_flight
    slots = Turns(lambda: min(limit, admission.batch_width(tenant) or limit))
    # Texts read, by request, only as fast as the stream's turns take them: each request's
    # deadline runs from its read, and 64 requests of 64 texts read at once waited for their
    # turns behind each other until the gateway's 10 s cap failed most of them, on a stream
    # with no deadline (a client probe: 47 of 80 DEADLINE_EXCEEDED; 0 of 40 as ModelInfers).
    texts = Turns(lambda: admission.stream_width(tenant))
    running: set[asyncio.Task[None]] = set()
    metrics.GATEWAY_CALLS.labels(method).inc()

    async def answer_one(message: M, weight: int) -> None:
        try:
            try:
                reply = await answer(message)
            finally:
                texts.release(weight)
            # Its slot is freed once the reply is written (below), not here.
            replies.put_nowait(reply)
        except BaseException:
            slots.release()  # cancelled before its reply was queued
            raise

    drained = half_closed = False

    async def read() -> None:
        nonlocal half_closed
        try:
            try:
                async for message in requests:
                    await slots.acquire()
                    weight = texts_of(message) if texts_of is not None else 0
                    try:
                        await texts.acquire(weight)
                    except BaseException:
                        slots.release()
                        raise
                    task = asyncio.create_task(answer_one(message, weight))
                    running.add(task)
                    task.add_done_callback(running.discard)
            except Undecodable:
                # The stream ends INVALID_ARGUMENT (the decoding wrapper says why), but what
                # was read before the bad message is answered first, as at a half-close.
                while running:
                    await asyncio.wait(set(running))
                raise
            half_closed = True  # a drain from now lets the stream end OK once answered
            while running:  # the client has half-closed: finish what it sent
                await asyncio.wait(set(running))
        finally:
            if not drained:  # a drain ends the stream once what was read is answered
                replies.put_nowait(_END)

    async def on_drain() -> None:
        nonlocal drained
        await gateway.stream_drain.wait()
        if half_closed:
            # The client sent everything it will: nothing is left for another replica, and
            # UNAVAILABLE would have it send the whole stream again.
            return
        drained = True
        reader.cancel()  # messages not read yet were never accepted
        while running:
            await asyncio.wait(set(running))
        replies.put_nowait(_DRAINED)

    reader = asyncio.create_task(read())
    drainer = asyncio.create_task(on_drain())
    try:
        while (reply := await replies.get()) is not _END and reply is not _DRAINED:
            yield reply
            slots.release()
        if reply is _DRAINED:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINED)
        await reader  # a read that failed ends the RPC with that failure
    finally:
        drainer.cancel()
        reader.cancel()
        for task in list(running):
            task.cancel()
        gateway.streams.close(tenant)


def _id_too_long(rid: str) -> gateway_pb2.PredictStreamResponse:
    """The refusal of a request whose id is over MAX_ID_BYTES: the id's first MAX_ID_BYTES
    bytes (whole characters) to match it by."""
    size = len(rid.encode())
    return gateway_pb2.PredictStreamResponse(
        id=clipped_id(rid),
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        message=f"PredictStreamRequest.id is {size} bytes; the limit is {MAX_ID_BYTES}: "
        "send a shorter id (this reply carries its first bytes)",
        trace_id=current_trace_id(),
    )


def clipped_id(rid: str) -> str:
    """A request id's first MAX_ID_BYTES bytes, whole characters: what a reply echoes."""
    return rid.encode()[:MAX_ID_BYTES].decode("utf-8", "ignore")
