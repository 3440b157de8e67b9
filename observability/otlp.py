"""OTLP/gRPC export of `spans.py:RecordedSpan`s: the SDK's exporter with a direct encoder.

Imported only when a process exports (it pulls in the OTLP protobufs and the exporter's gRPC
channel). The SDK's encoder groups spans by resource and scope and re-reads every span through
`ReadableSpan`; every span here has one resource and one scope, and `encode` builds the protobufs
from the record in one pass: about 31 us a span against 82 (`bench/scripts/span_cost.py`).

The SDK's exporter reads its TLS files once; a collector's CA or this process's client
certificate renewed in place (cert-manager rewriting a Secret volume) would go unused, and
once the old certificate expired every span would be refused until a restart. The files are
watched (runtime/file_watch.py, at most every TLS_RECHECK_S, from the exports) and, once
they change and pass the start-up checks again (export_tls.py), the next export dials a new
channel with them; files that do not pass leave the channel as it is, with one warning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import Attributes

from hopline.observability.export_tls import ExportTls, check_export_tls
from hopline.observability.spans import RecordedSpan
from hopline.runtime.file_watch import FileWatch
from hopline.runtime.tls import TLS_RECHECK_S

log = logging.getLogger("hopline.observability.otlp")

SCOPE = "hopline"

# OTLP's flags: "the is-remote bit is known", plus "remote" for a parent from another process.
_HAS_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


class OtlpSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC exporter, configured by the same OTEL_EXPORTER_OTLP_* variables,
    sending `RecordedSpan`s encoded by `encode`. `_translate_data` is the exporter's one
    encoding step (the same name and shape from 1.30 to today's 1.4x);
    tests/unit/test_spans.py fails if an upgrade moves it.

    `tls` (export_tls.py, checked at start, for `endpoint`): its files are watched and a
    change dials the exporter's channel again with them. That sets the SDK's `_credentials`
    and calls its `_initialize_channel_and_stub`, as its own reconnection after UNAVAILABLE
    does; tests/unit/test_span_export_rotation.py fails if an upgrade moves them. Exports
    run one at a time (the batch processor's lock), so no export is on the old channel."""

    def __init__(
        self,
        resource: Resource,
        tls: ExportTls | None = None,
        endpoint: str = "",
        recheck_s: float = TLS_RECHECK_S,
    ) -> None:
        super().__init__()
        self.resource = encode_resource(resource)
        self._endpoint_setting = endpoint
        files = [path for _, path in tls.files] if tls is not None and not tls.plaintext else []
        self._tls_watch = FileWatch(files, recheck_s) if files else None
        self.redials = 0
        self._failing_since: float | None = None  # monotonic: the first failed export of an outage
        self._failed_batches = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if self._tls_watch is not None and self._tls_watch.changed():
            self._redial()
        result = super().export(spans)
        if result is SpanExportResult.SUCCESS:
            if self._failing_since is not None:
                self._recovered()
        elif self._failing_since is None:
            self._failing_since = time.monotonic()
            self._failed_batches = 1
        else:
            self._failed_batches += 1
        return result

    def _recovered(self) -> None:
        # The SDK says each failure (logs.py:ExportTrouble, once a minute) but not the end
        # of an outage: an operator reading the log could not tell whether spans flowed again.
        assert self._failing_since is not None
        log.info(
            "span export to the collector works again",
            extra={
                "failed_batches": self._failed_batches,
                "failing_s": round(time.monotonic() - self._failing_since, 1),
            },
        )
        self._failing_since = None
        self._failed_batches = 0

    def _redial(self) -> None:
        try:
            tls = check_export_tls(os.environ, self._endpoint_setting)
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls.ca),
                private_key=_read(tls.client_key),
                certificate_chain=_read(tls.client_cert),
            )
        except (OSError, ValueError) as exc:
            log.warning(
                "the span exporter's TLS files changed but cannot be used; exporting with "
                "the ones in use",
                extra={"reason": str(exc)},
            )
            return
        old: Any = self._channel  # the SDK declares it None-only
        self._credentials = credentials
        self._initialize_channel_and_stub()  # type: ignore[no-untyped-call]
        if old is not None:
            old.close()
        self.redials += 1
        log.info("the span exporter's TLS files changed: dialled the collector again with them")

    def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
        return encode(self.resource, data)


def _read(setting: tuple[str, str] | None) -> bytes | None:
    """A TLS file's bytes, by its (variable, path); None where it is not set."""
    if setting is None:
        return None
    with open(setting[1], "rb") as file:
        return file.read()


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
