"""How the server's span wrapper (observability/tracing.py:ServerTracing) records a handler
that fails: an abort under the code it chose, an exception it did not expect under UNKNOWN
(what gRPC tells the caller), with the exception on the span. Real grpc.aio servers on
loopback, and the in-process channel that co-located services are called through."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, cast

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import StatusCode

from hopline.observability import metrics, tracing
from hopline.observability.tracing import ServerTracing
from hopline.runtime.inproc import InProcessChannel, _Context

SERVICE = "hopline.test.v1.Failing"
Behaviour = Callable[[bytes, Any], Awaitable[bytes]]


async def _raises(request: bytes, context: Any) -> bytes:
    raise ValueError("a servicer bug")


async def _aborts(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
    raise AssertionError("abort returned")


async def _unavailable(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "postprocess is down")
    raise AssertionError("abort returned")


async def _answers(request: bytes, context: Any) -> bytes:
    return request


HANDLERS: dict[str, Behaviour] = {
    "Raises": _raises,
    "Aborts": _aborts,
    "Unavailable": _unavailable,
    "Answers": _answers,
}


def _recorder(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    return exporter


def _recorded(method: str, code: grpc.StatusCode) -> int:
    return metrics.count(metrics.RPC_DURATION, service=SERVICE, method=method, code=code.name)


async def _over_grpc(method: str) -> grpc.StatusCode:
    wrapper = ServerTracing()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    name: grpc.unary_unary_rpc_method_handler(
                        wrapper.wrap(f"/{SERVICE}/{name}", behaviour)
                    )
                    for name, behaviour in HANDLERS.items()
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                call = channel.unary_unary(f"/{SERVICE}/{method}", None, None)
                await call(b"x", timeout=10)
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(None)


async def _in_process(method: str) -> grpc.StatusCode:
    handlers = {
        f"/{SERVICE}/{name}": grpc.unary_unary_rpc_method_handler(behaviour)
        for name, behaviour in HANDLERS.items()
    }
    channel = InProcessChannel(handlers, [ServerTracing()])
    try:
        await channel.unary_unary(f"/{SERVICE}/{method}")(b"x", timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


# (method, the code its caller sees, the span's status): a code answering the caller's own
# mistake is not the server's error (OpenTelemetry's RPC conventions); the span still says it.
CASES = [
    ("Raises", grpc.StatusCode.UNKNOWN, StatusCode.ERROR),
    ("Aborts", grpc.StatusCode.INVALID_ARGUMENT, StatusCode.UNSET),
    ("Unavailable", grpc.StatusCode.UNAVAILABLE, StatusCode.ERROR),
    ("Answers", grpc.StatusCode.OK, StatusCode.UNSET),
]


@pytest.mark.parametrize("transport", [_over_grpc, _in_process], ids=["grpc", "in_process"])
@pytest.mark.parametrize(("method", "expected", "span_status"), CASES)
def test_a_failed_rpc_is_recorded_under_the_status_its_caller_sees(
    monkeypatch: pytest.MonkeyPatch,
    transport: Callable[[str], Coroutine[Any, Any, grpc.StatusCode]],
    method: str,
    expected: grpc.StatusCode,
    span_status: StatusCode,
) -> None:
    exporter = _recorder(monkeypatch)
    before = {code: _recorded(method, code) for code in grpc.StatusCode}

    seen = asyncio.run(transport(method))

    assert seen == expected
    added = {code: _recorded(method, code) - before[code] for code in grpc.StatusCode}
    assert added == {code: int(code == expected) for code in grpc.StatusCode}
    (span,) = exporter.get_finished_spans()
    assert span.name == f"{SERVICE}/{method}"
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == expected.value[0]
    assert span.status.status_code == span_status
    exceptions = [event for event in span.events if event.name == "exception"]
    if expected is grpc.StatusCode.UNKNOWN:
        (event,) = exceptions
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "ValueError"
    else:
        assert exceptions == []  # an abort is the handler's answer, not an exception


def test_a_stream_whose_generator_is_closed_between_replies_is_cancelled(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """grpc closes a stream handler's generator (GeneratorExit at its `yield`) when the client
    goes away between two replies, from a context of its own: the span read OK, the RPC was
    counted OK, and restoring the span's context there logged 'Failed to detach context'."""
    exporter = _recorder(monkeypatch)
    method = f"/{SERVICE}/Stream"

    async def replies(request: Any, context: Any) -> Any:
        for n in range(10):
            yield f"reply {n}"

    async def run() -> None:
        context = cast(Any, _Context((), None))
        stream = cast(
            AsyncGenerator[Any], ServerTracing().wrap_stream(method, replies)(b"x", context)
        )
        assert await anext(stream) == "reply 0"
        # grpc's own task closes it, in another context than the one the span was made in.
        await asyncio.create_task(stream.aclose(), context=contextvars.Context())

    cancelled_before = _recorded("Stream", grpc.StatusCode.CANCELLED)
    ok_before = _recorded("Stream", grpc.StatusCode.OK)
    asyncio.run(run())
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert _recorded("Stream", grpc.StatusCode.CANCELLED) == cancelled_before + 1
    assert _recorded("Stream", grpc.StatusCode.OK) == ok_before
    assert not [r for r in caplog.records if "Failed to detach context" in r.getMessage()]
