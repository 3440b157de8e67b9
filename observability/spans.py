"""hopline's recording spans: the OpenTelemetry API's `Span`, without the SDK's per-span work.

A traced request writes 11-12 spans in the gateway (more across a five-process mesh). Measured
here (`bench/scripts/span_cost.py`): the SDK's span cost about 74 us of the request's own thread
to start and end (attribute cleaning under a lock, the span processor chain, a `ReadableSpan`
per span) and its OTLP encoder about 82 us a span in the export thread, so a traced co-located
miss paid about 1.9 ms of CPU on the cores the model runs on. hopline writes only string,
number and boolean attributes it chose itself, so none of that checking is needed: a
`RecordedSpan` is a plain record, handed at its end to the SDK's `BatchSpanProcessor` (its
queue, batches and OTEL_BSP_* settings), and `otlp.py:OtlpSpanExporter` encodes it straight
to the OTLP protobufs the SDK's exporter sends (its endpoint, headers, TLS, compression and
retries from the standard OTEL_EXPORTER_OTLP_* variables). Samplers are the SDK's, so
OTEL_TRACES_SAMPLER keeps its meaning.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util._decorator import _agnosticcontextmanager
from opentelemetry.util.types import Attributes, AttributeValue

SpanSink = Callable[["RecordedSpan"], None]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


class RecordedSpan(trace.Span):
    """One recorded span: what OTLP carries, nothing else. Not thread-safe: a span is written
    by the task that opened it, as every hopline span is."""

    __slots__ = (
        "_sink",
        "attributes",
        "context",
        "end_ns",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "start_ns",
        "status",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        start_ns: int,
        attributes: dict[str, AttributeValue],
        links: list[Link],
        sink: SpanSink | None,
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.links = links
        self.events: list[tuple[str, int, dict[str, AttributeValue]]] = []
        self.status = Status(StatusCode.UNSET)
        self._sink = sink

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return not self.end_ns

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if not self.end_ns:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if not self.end_ns:
            self.attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if not self.end_ns:
            self.events.append((name, timestamp or time.time_ns(), dict(attributes or {})))

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if not self.end_ns and context.is_valid:
            self.links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if not self.end_ns:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final, and a description belongs only to ERROR.
        if self.end_ns or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description if status is StatusCode.ERROR else None)
        self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        stack = "".join(
            traceback.format_exception(type(exception), exception, exception.__traceback__)
        )
        event: dict[str, AttributeValue] = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": stack,
            "exception.escaped": str(escaped),
        }
        event.update(attributes or {})
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns:
            return
        self.end_ns = end_time or time.time_ns()
        if self._sink is not None:
            self._sink(self)


class SpanTracer(trace.Tracer):
    """Starts `RecordedSpan`s where `sampler` records, non-recording spans (ids only, so the
    trace id still travels) where it does not; ended spans go to `sink`."""

    def __init__(self, sampler: Sampler, sink: SpanSink | None) -> None:
        self.sampler = sampler
        # Nothing is recorded (no exporter: tracing.default_sampler): a span is its ids.
        self._drops_all = sampler is ALWAYS_OFF
        self.sink = sink
        # The SDK's id generator draws from the random module's shared generator; one of our
        # own is not reseeded by whatever seeds that.
        self._bits = random.Random().getrandbits

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        trace_id = parent.trace_id if parent.is_valid else self._bits(128) or 1
        if self._drops_all:
            # What the sampler would decide, without asking it on every span.
            state = parent.trace_state if parent.is_valid else None
            ids = SpanContext(trace_id, self._bits(64) or 1, False, _NOT_SAMPLED, state)
            return trace.NonRecordingSpan(ids)
        decided = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        sampled = decided.decision is Decision.RECORD_AND_SAMPLE
        span_context = SpanContext(
            trace_id,
            self._bits(64) or 1,
            is_remote=False,
            trace_flags=_SAMPLED if sampled else _NOT_SAMPLED,
            trace_state=decided.trace_state,
        )
        if decided.decision is Decision.DROP:
            return trace.NonRecordingSpan(span_context)
        recorded: dict[str, AttributeValue] = dict(attributes or {})
        if decided.attributes:
            recorded.update(decided.attributes)
        return RecordedSpan(
            name,
            span_context,
            parent if parent.is_valid else None,
            kind,
            start_time or time.time_ns(),
            recorded,
            [link for link in links or () if link.context.is_valid],
            self.sink,
        )

    # The API's own decorator (the SDK's tracer uses it too): a context manager that is also
    # a decorator, as the `Tracer` interface declares.
    @_agnosticcontextmanager
    def start_as_current_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


# How long a stop waits for the spans still queued to be sent. The SDK's processor waits up
# to 30 s, retrying a collector that does not answer: a gateway whose collector was down took
# 30.6 s to exit after SIGTERM, past its pod's grace period once added to the drain.
FLUSH_AT_STOP_S = 2.0


class SpanTracerProvider(trace.TracerProvider):
    """One `SpanTracer` for every instrumentation name (hopline is the only one), and the
    processor its spans end in, flushed by `shutdown` for at most `flush_s`."""

    def __init__(
        self,
        sampler: Sampler,
        processor: Any | None = None,
        exporter: Any | None = None,
        flush_s: float = FLUSH_AT_STOP_S,
    ) -> None:
        self.processor = processor
        self.exporter = exporter
        self.flush_s = flush_s
        sink = None if processor is None else cast("SpanSink", processor.on_end)
        self.tracer = SpanTracer(sampler, sink)

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self.tracer

    def shutdown(self) -> None:
        """Flushes what is queued; past `flush_s` the exporter is shut, which ends its
        retries and its channel (the spans still queued are lost, as with a dead process)."""
        if self.processor is None:
            return
        flushing = threading.Thread(
            target=self.processor.shutdown, name="hopline-span-flush", daemon=True
        )
        flushing.start()
        flushing.join(self.flush_s)
        if flushing.is_alive() and self.exporter is not None:
            self.exporter.shutdown()
            flushing.join(self.flush_s)
