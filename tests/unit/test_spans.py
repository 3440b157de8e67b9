"""hopline's recording spans (observability/spans.py) and their OTLP encoding
(observability/otlp.py): the same parents, ids, attributes, events, links and status as the
SDK's spans, the same OTLP bytes as the SDK's encoder, and a real OTLP/gRPC export through the
SDK's batch processor to a collector listening on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from hopline.observability.otlp import SCOPE, OtlpSpanExporter, encode, encode_resource
from hopline.observability.spans import RecordedSpan, SpanTracer, SpanTracerProvider
from hopline.runtime.ports import free_ports

REMOTE = SpanContext(
    trace_id=0x0AF7651916CD43DD8448EB211C80319C,
    span_id=0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "value")]),
)


class Sink:
    def __init__(self) -> None:
        self.spans: list[RecordedSpan] = []

    def __call__(self, span: RecordedSpan) -> None:
        self.spans.append(span)


def _tracer(sampler: Any = None) -> tuple[SpanTracer, Sink]:
    sink = Sink()
    return SpanTracer(sampler or ParentBased(ALWAYS_ON), sink), sink


def test_children_take_their_parents_trace_and_id_and_end_once() -> None:
    tracer, sink = _tracer()
    remote = set_span_in_context(NonRecordingSpan(REMOTE))
    with tracer.start_as_current_span("server", context=remote, kind=SpanKind.SERVER) as root:
        with tracer.start_as_current_span("client", kind=SpanKind.CLIENT, attributes={"a": 1}):
            pass
        assert trace.get_current_span() is root
    root.end()  # a second end changes nothing
    child, server = sink.spans
    assert [s.name for s in sink.spans] == ["client", "server"]
    assert server.parent == REMOTE
    assert server.context.trace_id == REMOTE.trace_id
    assert child.parent == server.context
    assert child.context.trace_id == REMOTE.trace_id
    assert child.context.span_id != server.context.span_id
    assert child.kind is SpanKind.CLIENT
    assert child.attributes == {"a": 1}
    assert child.context.trace_flags.sampled
    assert not child.context.is_remote
    assert child.start_ns <= child.end_ns <= server.end_ns


def test_a_root_gets_a_new_trace_and_an_unsampled_one_no_record() -> None:
    tracer, sink = _tracer()
    with tracer.start_as_current_span("a") as a, tracer.start_as_current_span("b") as b:
        pass
    assert a.get_span_context().trace_id != 0
    assert a.get_span_context().is_valid
    assert isinstance(a, RecordedSpan)
    assert a.parent is None
    off, off_sink = _tracer(ALWAYS_OFF)
    with off.start_as_current_span("c") as c:
        # The trace id is still made: replies and logs carry it.
        assert c.get_span_context().is_valid
        assert not c.get_span_context().trace_flags.sampled
        assert not c.is_recording()
    assert isinstance(c, NonRecordingSpan)
    assert off_sink.spans == []
    assert len(sink.spans) == 2
    assert b.get_span_context().trace_id == a.get_span_context().trace_id


def test_exceptions_mark_the_span_unless_quiet() -> None:
    tracer, sink = _tracer()
    with pytest.raises(ValueError, match="bad row"), tracer.start_as_current_span("loud"):
        raise ValueError("bad row")
    with (
        pytest.raises(KeyError),
        tracer.start_as_current_span(
            "quiet", record_exception=False, set_status_on_exception=False
        ),
    ):
        raise KeyError("k")
    loud, quiet = sink.spans
    assert loud.status.status_code is StatusCode.ERROR
    assert loud.status.description == "ValueError: bad row"
    ((name, _, attrs),) = loud.events
    assert name == "exception"
    assert attrs["exception.type"] == "ValueError"
    assert "bad row" in str(attrs["exception.stacktrace"])
    assert quiet.status.status_code is StatusCode.UNSET
    assert quiet.events == []


def test_status_ok_is_final_and_nothing_changes_after_the_end() -> None:
    tracer, _ = _tracer()
    span = tracer.start_span("s")
    assert isinstance(span, RecordedSpan)
    span.set_status(StatusCode.OK, "ignored")
    span.set_status(Status(StatusCode.ERROR, "late"))
    assert span.status.status_code is StatusCode.OK
    assert span.status.description is None
    span.add_link(SpanContext(0, 0, is_remote=False))  # invalid: dropped
    span.end(end_time=span.start_ns + 5)
    span.set_attribute("after", 1)
    span.update_name("renamed")
    assert span.name == "s"
    assert "after" not in span.attributes
    assert span.links == []
    assert span.end_ns == span.start_ns + 5
    assert not span.is_recording()


def _full_span() -> RecordedSpan:
    tracer, _ = _tracer()
    links = [Link(REMOTE, {"why": "batch"}), Link(SpanContext(0, 0, is_remote=False))]
    span = tracer.start_span(
        "hopline.inference.v1.InferenceService/Infer",
        context=set_span_in_context(NonRecordingSpan(REMOTE)),
        kind=SpanKind.SERVER,
        attributes={"s": "x", "i": 7, "f": 0.25, "b": True, "seq": ("a", "b"), "n": [1, 2]},
        links=links,
        start_time=1_700_000_000_000_000_000,
    )
    assert isinstance(span, RecordedSpan)
    span.add_event("queued", {"rows": 3}, timestamp=1_700_000_000_000_000_500)
    span.set_status(StatusCode.ERROR, "RESOURCE_EXHAUSTED: queue full")
    span.end(end_time=1_700_000_000_000_009_000)
    return span


def _as_sdk(span: RecordedSpan, resource: Resource) -> ReadableSpan:
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=resource,
        attributes=span.attributes,
        events=[Event(n, attrs, timestamp=at) for n, at, attrs in span.events],
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_ns,
        end_time=span.end_ns,
        instrumentation_scope=InstrumentationScope(SCOPE),
    )


def test_the_encoding_is_the_sdks_byte_for_byte() -> None:
    resource = Resource.create({"service.name": "gateway"})
    spans = [_full_span(), _full_span()]
    ours = encode(encode_resource(resource), spans)
    sdk = encode_spans([_as_sdk(s, resource) for s in spans])
    assert ours == sdk
    assert ours.SerializeToString(deterministic=True) == sdk.SerializeToString(deterministic=True)
    span = ours.resource_spans[0].scope_spans[0].spans[0]
    assert span.parent_span_id == REMOTE.span_id.to_bytes(8, "big")
    assert span.trace_state == "vendor=value"
    assert len(span.links) == 1


def test_the_sdk_exporter_still_encodes_through_translate_data() -> None:
    """OtlpSpanExporter swaps the SDK exporter's one encoding step; an upgrade that renames it
    would send ReadableSpan-shaped requests of our records, so it must fail here first."""
    assert callable(getattr(OTLPSpanExporter, "_translate_data", None))
    assert "_translate_data" in OtlpSpanExporter.__dict__


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.arrived = threading.Event()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Collector]:
    """A real OTLP/gRPC trace collector on a loopback port, named by the standard variable."""
    servicer = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    try:
        yield servicer
    finally:
        server.stop(grace=None)


def test_spans_reach_a_collector_through_the_sdks_batch_processor(collector: _Collector) -> None:
    resource = Resource.create({"service.name": "gateway"})
    processor = BatchSpanProcessor(OtlpSpanExporter(resource), schedule_delay_millis=50)
    tracer = SpanTracer(ParentBased(ALWAYS_ON), processor.on_end)  # type: ignore[arg-type]
    with (
        tracer.start_as_current_span("root", kind=SpanKind.SERVER),
        tracer.start_as_current_span("hop", kind=SpanKind.CLIENT, attributes={"k": "v"}),
    ):
        pass
    processor.shutdown()  # type: ignore[no-untyped-call]
    assert collector.arrived.wait(10)
    (request,) = collector.requests
    (resource_spans,) = request.resource_spans
    names = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    assert names["service.name"] == "gateway"
    hop, root = resource_spans.scope_spans[0].spans
    assert (hop.name, root.name) == ("hop", "root")
    assert hop.parent_span_id == root.span_id
    assert hop.trace_id == root.trace_id
    assert hop.attributes[0].key == "k"
    assert hop.attributes[0].value.string_value == "v"


def test_a_stop_waits_a_bounded_time_for_a_collector_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens where the spans go: the SDK's processor retried for up to 30 s at a
    stop (a gateway took 30.6 s to exit after SIGTERM); the provider shuts the exporter once
    `flush_s` has passed, which ends the retries."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_ports(1)[0]}")
    exporter = OtlpSpanExporter(Resource.create({"service.name": "gateway"}))
    processor = BatchSpanProcessor(exporter, schedule_delay_millis=60_000)
    provider = SpanTracerProvider(ParentBased(ALWAYS_ON), processor, exporter, flush_s=0.5)
    for _ in range(3):
        with provider.tracer.start_as_current_span("root", kind=SpanKind.SERVER):
            pass
    started = time.monotonic()
    provider.shutdown()
    # The exporter's own retries of one batch alone last seconds (1 + 2 + 4 s of backoff).
    assert time.monotonic() - started < 4.0


_PROBE = """
from opentelemetry import trace
from hopline.observability import tracing
tracing.setup_tracing("gateway")
span = tracing.tracer().start_span("probe")
print(type(trace.get_tracer_provider()).__name__, type(span).__name__,
      span.get_span_context().is_valid)
tracing.shutdown_tracing()
"""


@pytest.mark.parametrize(
    ("env", "seen"),
    [
        ({}, "SpanTracerProvider NonRecordingSpan True"),  # nothing exported: ids only
        ({"OTEL_TRACES_SAMPLER": "always_on"}, "SpanTracerProvider RecordedSpan True"),
        ({"OTEL_SDK_DISABLED": "true"}, "NoOpTracerProvider NonRecordingSpan False"),
    ],
)
def test_a_process_sets_up_the_tracer_its_environment_asks_for(
    env: dict[str, str], seen: str
) -> None:
    """In a process of its own: the tracer provider is set once per process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split("\n")[0] == seen


def test_a_tracer_that_records_nothing_still_follows_its_parent() -> None:
    """With nothing exported the tracer skips the sampler, as the sampler would decide: a
    child keeps its parent's trace id and trace state, gets an id of its own, and is not
    sampled even under a sampled parent (ALWAYS_OFF drops every span)."""
    off, sink = _tracer(ALWAYS_OFF)
    child = off.start_span("child", context=set_span_in_context(NonRecordingSpan(REMOTE)))
    ids = child.get_span_context()
    assert isinstance(child, NonRecordingSpan)
    assert ids.trace_id == REMOTE.trace_id
    assert ids.span_id not in (0, REMOTE.span_id)
    assert ids.trace_state == REMOTE.trace_state
    assert not ids.trace_flags.sampled
    assert not ids.is_remote
    roots = {off.start_span("root").get_span_context().trace_id for _ in range(3)}
    assert len(roots) == 3
    assert 0 not in roots
    assert sink.spans == []
