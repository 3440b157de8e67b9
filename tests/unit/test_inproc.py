"""Co-location by address (hopline.runtime.inproc): a service's real servicer called through
its own generated stub in this process, with the statuses a remote caller would see.

No fakes: the tokenizer and postprocess servicers are the real ones over the default model
repository; nothing opens a socket.
"""

from __future__ import annotations

import asyncio
import contextvars
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import DEFAULT_MODEL
from hopline.observability import tracing
from hopline.observability.tracing import outgoing_metadata
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.fairness import FLOW, FairQueue
from hopline.runtime.inproc import InProcessService
from hopline.runtime.server import NOT_READY
from hopline.runtime.service_table import ServiceName, spec
from hopline.runtime.tensors import from_tensor, to_tensor


def _service(
    name: ServiceName, repo: Path, monkeypatch: pytest.MonkeyPatch, **env: str
) -> InProcessService:
    monkeypatch.setenv("HOPLINE_MODEL_REPO", str(repo))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return InProcessService.load(spec(name))


def test_tokenize_in_process_answers_like_the_service(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _service(ServiceName.TOKENIZER, default_repo, monkeypatch)
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(cast(grpc.aio.Channel, service.channel))
    request = tokenizer_pb2.TokenizeRequest(model=DEFAULT_MODEL, texts=["reset my password"])

    async def scenario() -> tokenizer_pb2.TokenizeResponse:
        with pytest.raises(grpc.aio.AioRpcError) as early:
            await stub.Tokenize(request, timeout=5)
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE  # not started: gated
        assert early.value.details() == NOT_READY
        await service.start()
        try:
            return await stub.Tokenize(request, timeout=5)
        finally:
            await service.stop()

    reply = asyncio.run(scenario())
    ids = from_tensor(reply.input_ids).ravel().tolist()
    assert ids[0] == 101  # [CLS]
    assert 102 in ids  # [SEP]


def test_an_abort_is_the_callers_status_and_a_slow_call_meets_its_deadline(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # HOPLINE_TEST_DELAY_MS delays every RPC in the server-side wrapper, as it does remotely.
    service = _service(
        ServiceName.POSTPROCESS, default_repo, monkeypatch, HOPLINE_TEST_DELAY_MS="200"
    )
    stub = postprocess_pb2_grpc.PostprocessServiceStub(cast(grpc.aio.Channel, service.channel))

    async def scenario() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
        await service.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Postprocess(
                    postprocess_pb2.PostprocessRequest(model="no-such-model"), timeout=5
                )
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub.Postprocess(
                    postprocess_pb2.PostprocessRequest(model=DEFAULT_MODEL), timeout=0.05
                )
            return unknown.value, late.value
        finally:
            await service.stop()

    unknown, late = asyncio.run(scenario())
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in (unknown.details() or "")
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_server_span_is_a_child_of_the_callers_span(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same trace shape as across a socket: client span -> server span, by traceparent."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = _service(ServiceName.TOKENIZER, default_repo, monkeypatch)
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(cast(grpc.aio.Channel, service.channel))

    async def scenario() -> None:
        await service.start()
        try:
            with provider.get_tracer("test").start_as_current_span("client"):
                metadata = outgoing_metadata()
            # Outside the client span: only the traceparent can link the two.
            await stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(model=DEFAULT_MODEL, texts=["hi"]),
                timeout=5,
                metadata=metadata,
            )
        finally:
            await service.stop()

    # hopline's tracer is looked up once per process; this test's provider stands in for it.
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    asyncio.run(scenario())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    client = spans["client"]
    server = next(s for s in spans.values() if s.kind == trace.SpanKind.SERVER)
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None
    assert server.parent.span_id == client.context.span_id


def test_a_callers_tenant_reaches_the_co_located_models_batcher(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's admission sets the request's tenant as its flow (runtime/fairness.py);
    a co-located inference service's batcher must see it through the in-process call, or
    every tenant's rows would queue as one. Six callers of three tenants at once: the first
    runs alone, the rest queue under their own tenant's name, none as nobody's."""
    service = _service(ServiceName.INFERENCE, default_repo, monkeypatch)
    stub = inference_pb2_grpc.InferenceServiceStub(cast(grpc.aio.Channel, service.channel))
    ids = np.array([[101, 7592, 2026, 20786, 102]], dtype=np.int64)
    request = inference_pb2.InferRequest(
        model=DEFAULT_MODEL,
        inputs=[to_tensor("input_ids", ids), to_tensor("attention_mask", np.ones_like(ids))],
        outputs=["logits"],
    )
    queued: list[object] = []
    push = FairQueue.push

    def recording_push(self: FairQueue[Any], item: Any, flow: Any = None, cost: int = 1) -> None:
        queued.append(flow)
        push(self, item, flow, cost)

    monkeypatch.setattr(FairQueue, "push", recording_push)

    async def infer() -> inference_pb2.InferResponse:
        return await stub.Infer(request, timeout=30)

    def as_tenant(tenant: str) -> asyncio.Task[inference_pb2.InferResponse]:
        context = contextvars.copy_context()
        context.run(FLOW.set, tenant)
        return asyncio.get_running_loop().create_task(infer(), context=context)

    async def scenario() -> list[inference_pb2.InferResponse]:
        await service.start()
        try:
            return await asyncio.gather(*(as_tenant(f"tenant-{n % 3}") for n in range(6)))
        finally:
            await service.stop()

    replies = asyncio.run(scenario())
    assert all(r.outputs for r in replies)
    assert queued, "nothing queued: every call ran alone"
    assert set(queued) <= {"tenant-0", "tenant-1", "tenant-2"}


def test_too_many_texts_name_the_setting_that_bounds_them(
    default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator reading the refusal learns which knob it is (it named only the number)."""
    service = _service(
        ServiceName.TOKENIZER, default_repo, monkeypatch, HOPLINE_TOKENIZER_MAX_BATCH="3"
    )
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(cast(grpc.aio.Channel, service.channel))

    async def scenario() -> grpc.aio.AioRpcError:
        await service.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Tokenize(
                    tokenizer_pb2.TokenizeRequest(model=DEFAULT_MODEL, texts=["hi"] * 4),
                    timeout=5,
                )
            return refused.value
        finally:
            await service.stop()

    refused = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 texts in one request; the limit is 3" in (refused.details() or "")
    assert "HOPLINE_TOKENIZER_MAX_BATCH" in (refused.details() or "")
