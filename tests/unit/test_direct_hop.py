"""A co-located stage's short way (hopline.gateway.direct_hop.StageHop): a request whose trace
is not recorded goes straight to the servicer, with the reply, timing, metrics and failures
the layered path (call_hop, the in-process stub and its wrappers) gives.

The tokenizer is the real servicer over the default model repository, in this process. One
stand-in: a tokenizer servicer that waits for the test before it answers (the real one never
yields), so further requests arrive while the first is in it. Nothing opens a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import DEFAULT_MODEL
from hopline.gateway.direct_hop import StageHop
from hopline.gateway.upstream import CoLocated, HopError
from hopline.observability import metrics, schema, tracing
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.inproc import InProcessService
from hopline.runtime.server import NOT_READY
from hopline.runtime.service_table import ServiceName, spec
from hopline.runtime.tensors import from_tensor, to_tensor

Tokenize = StageHop[tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse]
TOKENIZE_RPC = ("hopline.tokenizer.v1.TokenizerService", "Tokenize")


if TYPE_CHECKING:  # the async stub's type exists only in the generated .pyi
    _TokenizerPool = CoLocated[tokenizer_pb2_grpc.TokenizerServiceAsyncStub]
else:
    _TokenizerPool = CoLocated


class _CountingPool(_TokenizerPool):
    """The real CoLocated pool, counting the stubs asked of it: the layered path's calls."""

    def __init__(self, service: InProcessService) -> None:
        super().__init__(service, tokenizer_pb2_grpc.TokenizerServiceStub)
        self.stubs = 0

    def stub(self) -> tokenizer_pb2_grpc.TokenizerServiceAsyncStub:
        self.stubs += 1
        return super().stub()


def _tokenizer(repo: Path, monkeypatch: pytest.MonkeyPatch) -> _CountingPool:
    monkeypatch.setenv("HOPLINE_MODEL_REPO", str(repo))
    return _CountingPool(InProcessService.load(spec(ServiceName.TOKENIZER)))


def _run(pool: _CountingPool, scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def started() -> Any:
        await pool.start()
        try:
            return await scenario()
        finally:
            await pool.close()

    return asyncio.run(started())


def _request(model: str = DEFAULT_MODEL) -> tokenizer_pb2.TokenizeRequest:
    return tokenizer_pb2.TokenizeRequest(model=model, texts=["reset my password"])


def test_an_unrecorded_request_goes_straight_to_the_servicer(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same reply as the layered path, the hop's timing and metric, the service's RPC metric,
    and no stub asked for."""
    pool = _tokenizer(default_repo, monkeypatch)
    hop = Tokenize(schema.SPAN_TOKENIZE, pool, None, "Tokenize")
    hops = metrics.count(metrics.HOP_DURATION, hop=schema.SPAN_TOKENIZE, code="OK")
    rpcs = metrics.count(metrics.RPC_DURATION, service=TOKENIZE_RPC[0], method="Tokenize")

    async def scenario() -> tuple[Any, Any, dict[str, float]]:
        timings: dict[str, float] = {}
        direct = await hop(_request(), 5.0, timings)
        layered = await pool.stub().Tokenize(_request(), timeout=5.0)
        return direct, layered, timings

    direct, layered, timings = _run(pool, scenario)
    assert direct == layered
    assert pool.stubs == 1  # the layered call above, not the hop
    assert timings[schema.SPAN_TOKENIZE] > 0
    assert metrics.count(metrics.HOP_DURATION, hop=schema.SPAN_TOKENIZE, code="OK") == hops + 1
    # The hop's call and the stub's both count as the service's RPCs.
    assert (
        metrics.count(metrics.RPC_DURATION, service=TOKENIZE_RPC[0], method="Tokenize") == rpcs + 2
    )


def test_a_recorded_trace_takes_the_layered_path_with_its_spans(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Traces read as before: a request whose trace is recorded gets the hop's client span
    and the service's server span under it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    pool = _tokenizer(default_repo, monkeypatch)
    hop = Tokenize(schema.SPAN_TOKENIZE, pool, None, "Tokenize")

    async def scenario() -> None:
        with provider.get_tracer("test").start_as_current_span("request"):
            await hop(_request(), 5.0, {})

    _run(pool, scenario)
    assert pool.stubs == 1
    spans = {s.name: s for s in exporter.get_finished_spans()}
    client = spans[schema.SPAN_TOKENIZE]
    server = next(s for s in spans.values() if s.kind == trace.SpanKind.SERVER)
    assert server.parent is not None
    assert server.parent.span_id == client.context.span_id
    assert client.parent is not None
    assert client.parent.span_id == spans["request"].context.span_id


def test_failures_are_the_same_hop_errors_either_way(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown model is NOT_FOUND and a spent deadline DEADLINE_EXCEEDED, with the same
    message, whether the request went straight or through the layers."""
    pool = _tokenizer(default_repo, monkeypatch)
    direct = Tokenize(schema.SPAN_TOKENIZE, pool, None, "Tokenize")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))

    async def failure(recorded: bool, request: Any, timeout_s: float) -> HopError:
        # A recorded trace takes the layered path.
        tracer = provider.get_tracer("test")
        around = tracer.start_as_current_span("request") if recorded else contextlib.nullcontext()
        with around, pytest.raises(HopError) as caught:
            await direct(request, timeout_s, {})
        return caught.value

    async def scenario() -> list[tuple[HopError, HopError]]:
        cases = [(_request("no-such-model"), 5.0), (_request(), 0.0)]
        return [(await failure(False, r, t), await failure(True, r, t)) for r, t in cases]

    (missing, layered_missing), (late, layered_late) = _run(pool, scenario)
    assert pool.stubs == 2  # the two recorded requests only
    assert missing.code == layered_missing.code == grpc.StatusCode.NOT_FOUND
    assert str(missing) == str(layered_missing)
    assert "no-such-model" in str(missing)
    assert late.code == layered_late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(late) == str(layered_late)


def test_a_service_not_started_is_refused_as_the_layered_path_refuses(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate still decides: before its service starts, a hop is UNAVAILABLE as a remote
    call would be, with the gate's own words, and without a detour through the stub."""
    pool = _tokenizer(default_repo, monkeypatch)
    hop = Tokenize(schema.SPAN_TOKENIZE, pool, None, "Tokenize")

    async def scenario() -> HopError:
        with pytest.raises(HopError) as caught:
            await hop(_request(), 5.0, {})
        return caught.value

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert refused.details == NOT_READY
    assert pool.stubs == 0


class _HeldTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Answers each call's texts back as their lengths once the test lets it go."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[list[str]] = []

    def register(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(self, server)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: Any
    ) -> tokenizer_pb2.TokenizeResponse:
        self.calls.append(list(request.texts))
        await self.release.wait()
        lengths = np.array([[len(t)] for t in request.texts], dtype=np.int64)
        return tokenizer_pb2.TokenizeResponse(
            input_ids=to_tensor("input_ids", lengths),
            attention_mask=to_tensor("attention_mask", np.ones_like(lengths)),
        )


def test_requests_meanwhile_go_straight_too_each_alone() -> None:
    """A co-located stage is not batched by the gateway (gateway/stage_batching.py:
    GatewayStages.over): while one request is in the servicer, the next ones reach it too,
    each with its own call and none through the layers."""
    servicer = _HeldTokenizer()
    pool = _CountingPool(InProcessService("tokenizer", servicer))  # type: ignore[arg-type]
    hop = Tokenize(schema.SPAN_TOKENIZE, pool, None, "Tokenize")

    def request(text: str) -> tokenizer_pb2.TokenizeRequest:
        return tokenizer_pb2.TokenizeRequest(model=DEFAULT_MODEL, texts=[text])

    async def scenario() -> list[Any]:
        calls = [asyncio.ensure_future(hop(request(t), 5.0, {})) for t in ("a", "bb", "ccc")]
        await asyncio.sleep(0.01)
        assert servicer.calls == [["a"], ["bb"], ["ccc"]]  # all three in it at once
        servicer.release.set()
        return list(await asyncio.gather(*calls))

    replies = _run(pool, scenario)
    assert pool.stubs == 0
    assert [int(from_tensor(r.input_ids)[0][0]) for r in replies] == [1, 2, 3]
