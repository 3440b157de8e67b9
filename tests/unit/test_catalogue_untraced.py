"""The gateway re-reads the model list every HOPLINE_MODEL_REFRESH_S (and at start-up): work
of its own, no request's. It made a root `list_models` trace each time, and inference a
root ListModels server trace under it: with `parentbased_always_on` (or Jaeger's sampler
keeping roots) one trace every 10 s per gateway, burying the requests' traces. Now those
reads run in a trace that is not recorded: no span here, and the `traceparent` sent says
not sampled, so the callee's parent-based sampler records none either. A read made for a
request naming an unknown model stays in that request's trace
(tests/mesh/test_tracing_jaeger.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hopline.gateway.catalogue import ModelCatalogue
from hopline.observability import schema, tracing
from hopline.protos.hopline.inference.v1 import inference_pb2


class Inference:
    """The inference pool's stub: ListModels answers one model and keeps what it was sent."""

    target = "stand-in"

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.three = asyncio.Event()  # three reads made

    def stub(self) -> Inference:
        return self

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, **kwargs: Any
    ) -> inference_pb2.ListModelsResponse:
        self.sent.append(dict(kwargs.get("metadata", ())))
        if len(self.sent) >= 3:
            self.three.set()
        return inference_pb2.ListModelsResponse(
            models=[inference_pb2.ModelInfo(name="m", version="1")]
        )

    async def close(self) -> None:
        return None


def sampled(traceparent: str) -> bool:
    """The W3C `sampled` flag: bit 0 of the last field."""
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    return exporter


def test_periodic_model_list_reads_make_no_trace(exporter: InMemorySpanExporter) -> None:
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]  # a stand-in pool

    async def follow_a_while() -> None:
        task = asyncio.ensure_future(catalogue.follow(0.01))
        async with asyncio.timeout(10):
            await inference.three.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(follow_a_while())
    assert exporter.get_finished_spans() == ()
    for metadata in inference.sent:
        assert not sampled(metadata["traceparent"]), metadata
    assert ("m", "1") in catalogue.models


def test_a_read_within_a_recorded_request_is_in_its_trace(exporter: InMemorySpanExporter) -> None:
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]  # a stand-in pool

    async def read_in_a_request() -> None:
        with tracing.tracer().start_as_current_span("request"):
            await catalogue.refresh()

    asyncio.run(read_in_a_request())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"request", "list_models"}
    assert spans["list_models"].parent is not None
    assert spans["list_models"].parent.span_id == spans["request"].context.span_id
    # Named as every other hop's client span is, for Jaeger's searches and `trace report`.
    assert spans["list_models"].attributes == {
        "rpc.system": "grpc",
        "server.address": "stand-in",
        schema.HOP: schema.SPAN_LIST_MODELS,
    }
    assert sampled(inference.sent[0]["traceparent"])
