"""OTLP/gRPC export of `spans.py:RecordedSpan`s: the SDK's exporter with a direct encoder.

Imported only when a process exports (it pulls in the OTLP protobufs and the exporter's gRPC
channel). The SDK's encoder groups spans by resource and scope and re-reads every span through
`ReadableSpan`; every span here has one resource and one scope, and `encode` builds the protobufs
from the record in one pass: about 31 us a span against 82 (`bench/scripts/span_cost.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import Attributes

from hopline.observability.spans import RecordedSpan

SCOPE = "hopline"

# OTLP's flags: "the is-remote bit is known", plus "remote" for a parent from another process.
_HAS_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


class OtlpSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC exporter, configured by the same OTEL_EXPORTER_OTLP_* variables,
    sending `RecordedSpan`s encoded by `encode`. `_translate_data` is the exporter's one
    encoding step (the same name and shape from 1.30 to today's 1.4x);
    tests/unit/test_spans.py fails if an upgrade moves it."""

    def __init__(self, resource: Resource) -> None:
        super().__init__()
        self.resource = encode_resource(resource)

    def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
        return encode(self.resource, data)


def encode_resource(resource: Resource) -> resource_pb2.Resource:
    return resource_pb2.Resource(attributes=_attributes(resource.attributes))


def encode(
    resource: resource_pb2.Resource, spans: Sequence[RecordedSpan]
) -> ExportTraceServiceRequest:
    """One OTLP request: every span under one resource and hopline's scope."""
    scope = trace_pb2.ScopeSpans(
        scope=common_pb2.InstrumentationScope(name=SCOPE), spans=[_span(s) for s in spans]
    )
    return ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(resource=resource, scope_spans=[scope])]
    )


def _span(span: RecordedSpan) -> trace_pb2.Span:
    context, parent = span.context, span.parent
    status = span.status
    return trace_pb2.Span(
        trace_id=context.trace_id.to_bytes(16, "big"),
        span_id=context.span_id.to_bytes(8, "big"),
        trace_state=context.trace_state.to_header() if context.trace_state else "",
        parent_span_id=parent.span_id.to_bytes(8, "big") if parent else b"",
        flags=_flags(parent),
        name=span.name,
        # OTLP counts from SPAN_KIND_UNSPECIFIED = 0, the API from INTERNAL = 0.
        kind=trace_pb2.Span.SpanKind.ValueType(span.kind.value + 1),
        start_time_unix_nano=span.start_ns,
        end_time_unix_nano=span.end_ns,
        attributes=_attributes(span.attributes),
        events=[
            trace_pb2.Span.Event(name=name, time_unix_nano=at, attributes=_attributes(attrs))
            for name, at, attrs in span.events
        ],
        links=[
            trace_pb2.Span.Link(
                trace_id=link.context.trace_id.to_bytes(16, "big"),
                span_id=link.context.span_id.to_bytes(8, "big"),
                attributes=_attributes(link.attributes),
                flags=_flags(link.context),
            )
            for link in span.links
        ],
        status=trace_pb2.Status(
            code=trace_pb2.Status.StatusCode.ValueType(status.status_code.value),
            message=status.description or "",
        ),
    )


def _flags(context: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | _IS_REMOTE if context and context.is_remote else _HAS_IS_REMOTE


def _attributes(attributes: Attributes) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=_value(v)) for k, v in (attributes or {}).items()]


def _value(value: Any) -> common_pb2.AnyValue:
    # bool before int: a bool is an int to isinstance.
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, str):
        return common_pb2.AnyValue(string_value=value)
    if isinstance(value, bytes):
        return common_pb2.AnyValue(bytes_value=value)
    if isinstance(value, Sequence):
        return common_pb2.AnyValue(
            array_value=common_pb2.ArrayValue(values=[_value(v) for v in value])
        )
    return common_pb2.AnyValue(string_value=str(value))
