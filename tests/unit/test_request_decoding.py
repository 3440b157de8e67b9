"""Client mistakes end with clear statuses, in-process (no sockets).

- Request bytes are decoded by the runtime's wrapper, not by grpc: a message that does not
  parse (corrupt bytes, a string field that is not UTF-8) is INVALID_ARGUMENT with a short
  message, counted, and logged as one warning without a traceback, for every kind of RPC.
- The gateway refuses a cache_mode outside the enum, echoes client strings clipped, and names
  a failing hop without its address.

KServe's stubs are not imported here: they share the protobuf package `inference` with
tritonclient's, which the mesh lane loads into the same pytest process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest
from gateway_fakes import Models, Pool
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import StatusCode
from servicer_context import Aborted, AbortingContext

from hopline.gateway import upstream
from hopline.gateway.call import check_cache_mode
from hopline.gateway.config import GatewayConfig
from hopline.gateway.errors import RequestError
from hopline.gateway.service import GatewayService
from hopline.gateway.upstream import GatewayUpstreams, HopError, call_hop, caller_details
from hopline.observability import metrics, tracing
from hopline.observability.logs import Episodes
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime.errors import ECHO_CHARS, clip
from hopline.runtime.interceptors import (
    Behaviour,
    Context,
    RpcWrapper,
    StreamBehaviour,
    wrap_handler,
)
from hopline.runtime.server import ReadinessGate

PREDICT = "/hopline.gateway.v1.GatewayService/Predict"
STREAM = "/hopline.gateway.v1.GatewayService/PredictStream"
PROBE = "/inference.GRPCInferenceService/ServerLive"
VALID = gateway_pb2.PredictRequest(text="where is my parcel", top_k=2).SerializeToString()
# Field 1 (text), length 2, two bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xff\xfe"
CORRUPT = b"\xff\xff\xff\xff"
TRUNCATED = VALID[:5]  # the text's length prefix promises more than follows
REPLY = gateway_pb2.PredictResponse(model="m")


class Recorder(RpcWrapper):
    """A wrapper that records what reaches it and what leaves it."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.raised: list[BaseException] = []

    def wrap(self, method: str, inner: Behaviour) -> Behaviour:
        async def recorded(request: Any, context: Context) -> Any:
            self.seen.append(request)
            try:
                return await inner(request, context)
            except BaseException as exc:
                self.raised.append(exc)
                raise

        return recorded

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        async def recorded(request: Any, context: Context) -> AsyncIterator[Any]:
            self.seen.append(request)
            async for reply in inner(request, context):
                yield reply

        return recorded


def undecodable(method: str) -> int:
    service, _, rpc = method.lstrip("/").rpartition("/")
    return metrics.count(metrics.UNDECODABLE_REQUESTS, service=service, method=rpc)


def unary_handler(method: str = PREDICT, *wrappers: RpcWrapper) -> tuple[Any, list[Any]]:
    got: list[Any] = []

    async def predict(request: gateway_pb2.PredictRequest, context: Any) -> Any:
        got.append(request)
        return REPLY

    handler = grpc.unary_unary_rpc_method_handler(
        predict,
        request_deserializer=gateway_pb2.PredictRequest.FromString,
        response_serializer=gateway_pb2.PredictResponse.SerializeToString,
    )
    return wrap_handler(method, handler, wrappers), got


def call(handler: Any, data: bytes) -> tuple[Any, AbortingContext]:
    context = AbortingContext()

    async def main() -> Any:
        try:
            return await handler.unary_unary(data, context)
        except Aborted:
            return None

    return asyncio.run(main()), context


async def feed(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


# -- decoding ---------------------------------------------------------------------------------


def test_grpc_hands_over_raw_bytes_and_a_valid_request_is_decoded_once() -> None:
    recorder = Recorder()
    handler, got = unary_handler(PREDICT, recorder)
    assert handler.request_deserializer is None  # grpc no longer parses (nor fails) for us
    assert handler.response_serializer is not None
    reply, context = call(handler, VALID)
    assert reply == REPLY
    assert context.aborted is None
    [request] = got
    assert (request.text, request.top_k) == ("where is my parcel", 2)
    # Decoding is innermost: the wrappers (gate, tracing) see the raw bytes, so an
    # undecodable request is still gated, traced and timed with its status.
    assert recorder.seen == [VALID]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (CORRUPT, "corrupt"),
        (TRUNCATED, "corrupt"),
        (BAD_UTF8, "UTF-8"),
    ],
    ids=["corrupt", "truncated", "bad-utf8"],
)
def test_an_undecodable_request_is_invalid_argument_counted_and_warned_once(
    data: bytes, reason: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    method = f"/hopline.test.v1.Decoding/{reason.replace('-', '')}{len(data)}"
    monkeypatch.setattr("hopline.runtime.interceptors.monotonic", lambda: 1e6)
    recorder = Recorder()
    handler, got = unary_handler(method, recorder)
    before = undecodable(method)
    with caplog.at_level(logging.DEBUG):
        reply, context = call(handler, data)
    assert reply is None
    assert got == []  # the servicer never ran
    assert context.aborted is not None
    code, message = context.aborted
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("the request is not a valid hopline.gateway.v1.PredictRequest: ")
    assert reason in message
    assert len(message) < 200
    assert "Traceback" not in message
    # Under the wrappers: a wrapper (the tracing one) sees the abort and records its status.
    assert [type(e) for e in recorder.raised] == [Aborted]
    assert undecodable(method) == before + 1
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1
    [record] = records
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert record.getMessage() == "undecodable request refused"
    assert cast(Any, record).method == method


def test_a_flood_of_garbage_is_counted_in_full_but_logged_once_a_second(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    method = "/hopline.test.v1.Decoding/Flood"
    now = [5e6]
    monkeypatch.setattr("hopline.runtime.interceptors.monotonic", lambda: now[0])
    handler, _ = unary_handler(method)
    before = undecodable(method)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            assert call(handler, CORRUPT)[1].aborted is not None
        now[0] += 1.5
        assert call(handler, BAD_UTF8)[1].aborted is not None
    assert undecodable(method) == before + 51
    warnings = [r for r in caplog.records if r.getMessage() == "undecodable request refused"]
    # The first at once; 1.5 s later one line for the 49 not logged and this one.
    assert [getattr(r, "more_failures", 0) for r in warnings] == [0, 50]


def test_a_request_stream_is_decoded_message_by_message() -> None:
    got: list[gateway_pb2.PredictStreamRequest] = []

    async def predict_stream(
        requests: AsyncIterator[gateway_pb2.PredictStreamRequest], context: Any
    ) -> AsyncIterator[gateway_pb2.PredictStreamResponse]:
        async for message in requests:
            got.append(message)
            yield gateway_pb2.PredictStreamResponse(id=message.id)

    handler: Any = wrap_handler(
        STREAM,
        grpc.stream_stream_rpc_method_handler(
            predict_stream,
            request_deserializer=gateway_pb2.PredictStreamRequest.FromString,
            response_serializer=gateway_pb2.PredictStreamResponse.SerializeToString,
        ),
        [Recorder()],
    )
    assert handler.request_deserializer is None
    first = gateway_pb2.PredictStreamRequest(id="a").SerializeToString()
    context = AbortingContext()
    replies: list[str] = []

    async def answer() -> None:
        async for reply in handler.stream_stream(feed(first, CORRUPT, first), context):
            replies.append(reply.id)

    async def main() -> None:
        with pytest.raises(Aborted):
            await answer()

    asyncio.run(main())
    assert replies == ["a"]  # answered before the bad message arrived
    assert [m.id for m in got] == ["a"]  # nothing after it is read
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "hopline.gateway.v1.PredictStreamRequest" in context.aborted[1]


def test_unary_stream_and_stream_unary_decode_too() -> None:
    async def watch(request: gateway_pb2.PredictRequest, context: Any) -> AsyncIterator[str]:
        yield request.text

    async def collect(requests: AsyncIterator[gateway_pb2.PredictRequest], context: Any) -> str:
        return ",".join([r.text async for r in requests])

    des = gateway_pb2.PredictRequest.FromString
    watching: Any = wrap_handler(
        "/t.v1.S/Watch", grpc.unary_stream_rpc_method_handler(watch, des), [Recorder()]
    )
    collecting: Any = wrap_handler(
        "/t.v1.S/Collect", grpc.stream_unary_rpc_method_handler(collect, des), [Recorder()]
    )
    one = gateway_pb2.PredictRequest(text="x").SerializeToString()

    async def main() -> None:
        assert [t async for t in watching.unary_stream(one, AbortingContext())] == ["x"]
        context = AbortingContext()
        with pytest.raises(Aborted):
            _ = [t async for t in watching.unary_stream(BAD_UTF8, context)]
        assert context.aborted is not None
        assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert await collecting.stream_unary(feed(one, one), AbortingContext()) == "x,x"
        context = AbortingContext()
        with pytest.raises(Aborted):
            await collecting.stream_unary(feed(one, CORRUPT), context)
        assert context.aborted is not None
        assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())


def test_probes_are_decoded_but_not_wrapped() -> None:
    recorder = Recorder()
    handler, _ = unary_handler(PROBE, recorder)
    assert handler.request_deserializer is None
    reply, _ = call(handler, VALID)
    assert reply == REPLY
    assert recorder.seen == []  # neither gated nor traced: a probe answers while starting
    _, context = call(handler, CORRUPT)
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_the_readiness_gate_still_comes_first() -> None:
    gate = ReadinessGate()
    handler, _ = unary_handler("/hopline.test.v1.Decoding/Gated", gate)
    _, context = call(handler, CORRUPT)
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.UNAVAILABLE  # not ready: nothing decoded
    gate.ready = True
    assert call(handler, VALID)[0] == REPLY


# -- the gateway's own checks -----------------------------------------------------------------


def test_clip() -> None:
    assert clip("support-intents") == "support-intents"
    long = clip("m" * 16_384)
    assert len(long) == ECHO_CHARS
    assert long.endswith("\u2026")
    assert long.startswith("m" * (ECHO_CHARS - 1))


@pytest.mark.parametrize("mode", [4, 99, -1, 2**31 - 1])
def test_a_cache_mode_outside_the_enum_is_invalid_argument(mode: int) -> None:
    with pytest.raises(RequestError) as refused:
        check_cache_mode(mode)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(mode) in refused.value.message
    assert "CACHE_MODE_USE" in refused.value.message


@pytest.mark.parametrize("mode", common_pb2.CacheMode.values())
def test_every_cache_mode_of_the_enum_is_accepted(mode: int) -> None:
    check_cache_mode(mode)


def test_hop_errors_name_the_hop_not_the_address(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failures are logged once an episode: a fresh one, whatever ran before in this process.
    monkeypatch.setattr(upstream, "HOP_FAILURES", Episodes(upstream.log, "hop failed"))
    target = "10.1.2.3:8011"
    details = f"failed to connect to all addresses; last error: UNKNOWN: ipv4:{target}: refused"

    async def failing(code: grpc.StatusCode) -> HopError:
        async def rpc(request: Any, **_: Any) -> Any:
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None
            )

        with pytest.raises(HopError) as failed:
            await call_hop("tokenize", target, rpc, None, 1.0, {})
        return failed.value

    with caplog.at_level(logging.WARNING):
        for code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ):
            error = asyncio.run(failing(code))
            assert "tokenize" in error.message
            assert "10.1.2.3" not in error.message
            assert (error.target, error.details) == (target, details)  # for logs and spans
    # The server-side faults are logged with the address; the message above had none.
    logged = [r for r in caplog.records if r.getMessage() == "hop failed"]
    assert [cast(Any, r).status for r in logged] == ["UNAVAILABLE", "UNKNOWN"]
    assert all(cast(Any, r).target == target for r in logged)


def test_caller_details_hide_addresses_and_stay_short() -> None:
    assert caller_details("down at cache.local:9 now", "cache.local:9") == "down at <address> now"
    scrubbed = caller_details("peer ipv6:[::1]:80, 127.0.0.1:5 and unix:/run/x.sock", "t:1")
    assert "::1" not in scrubbed
    assert "127.0.0.1" not in scrubbed
    assert "/run/x.sock" not in scrubbed
    assert caller_details("Expected [-1], got [2]", "t:1") == "Expected [-1], got [2]"
    assert len(caller_details("x" * 10_000, "t:1")) <= 300


@pytest.mark.parametrize(
    ("name", "version"),
    [("n" * 16_384, ""), ("intents", "9" * 16_384), ("quoted'\"\x00" * 1000, "1")],
    ids=["long-name", "long-version", "odd-characters"],
)
def test_an_unknown_model_is_not_found_with_its_name_clipped(name: str, version: str) -> None:
    async def main() -> RequestError:
        pools = [Pool(object()), Pool(object()), Pool(Models()), Pool(object())]
        gateway = GatewayService(
            GatewayConfig(local_exact_entries=0), GatewayUpstreams(*cast(Any, pools))
        )
        await gateway.catalogue.refresh()
        with pytest.raises(RequestError) as refused:
            await gateway.resolve_model(name, version)
        return refused.value

    error = asyncio.run(main())
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert len(error.message) < 4 * ECHO_CHARS
    assert "\u2026" in error.message
    assert "intents/1" in error.message  # what is served, as for any unknown model


def test_a_short_unknown_model_keeps_the_catalogues_message() -> None:
    async def main() -> RequestError:
        pools = [Pool(object()), Pool(object()), Pool(Models()), Pool(object())]
        gateway = GatewayService(
            GatewayConfig(local_exact_entries=0), GatewayUpstreams(*cast(Any, pools))
        )
        await gateway.catalogue.refresh()
        with pytest.raises(RequestError) as refused:
            await gateway.resolve_model("no-such-model", "")
        return refused.value

    error = asyncio.run(main())
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in error.message


def test_a_refusal_of_the_gateway_itself_is_not_passed_on_word_for_word() -> None:
    """An upstream that refuses the gateway's certificate (an operator's mistake) said to the
    tenant which certificates it serves and told them to call through the gateway (a security
    probe): the tenant now hears that the hop refused the gateway; the details go to the log."""
    details = "this service serves only gateway, operator; the caller's certificate names x"
    for code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)
        failure = upstream._hop_error("tokenize", "10.1.2.3:8011", err)
        assert failure.code == grpc.StatusCode.INTERNAL
        assert failure.message == (
            f"tokenize failed: the tokenize service refused the gateway ({code.name}; the "
            "gateway's log says why)"
        )
        assert failure.details == details


def test_a_hop_not_called_for_want_of_time_or_given_up_is_an_error_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hop skipped with no deadline left, or cancelled by its request, ended as an unmarked
    span while its metric said DEADLINE_EXCEEDED or CANCELLED (an observability probe)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))

    async def never(request: Any, **_: Any) -> Any:
        await asyncio.sleep(60)

    async def both() -> None:
        with tracing.tracer().start_as_current_span("request"):
            with pytest.raises(HopError):
                await call_hop("postprocess", "127.0.0.1:1", never, None, 0.0, {})
            call = asyncio.ensure_future(call_hop("inference", "127.0.0.1:1", never, None, 5, {}))
            await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(both())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    skipped, gone = spans["postprocess"], spans["inference"]
    assert skipped.status.status_code == StatusCode.ERROR
    assert skipped.status.description == (
        "DEADLINE_EXCEEDED: deadline exceeded before calling the postprocess service"
    )
    assert gone.status.status_code == StatusCode.ERROR
    assert (gone.status.description or "").startswith("CANCELLED")
