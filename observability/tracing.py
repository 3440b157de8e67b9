"""OpenTelemetry tracing: provider set-up and W3C trace context across gRPC hops.

Every hop gets a server span whose parent comes from the `traceparent` metadata the caller
sent; the gateway opens a client span per upstream call and injects the context. Health and
reflection RPCs are not traced: probes would drown the traces that matter.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from hopline.interceptors import Behaviour, UnaryInterceptor

log = logging.getLogger("hopline.tracing")


def setup_tracing(service: str) -> None:
    """Install the global tracer provider for this process.

    Spans always get ids (the trace id is returned to clients); they are exported only when
    OTEL_EXPORTER_OTLP_ENDPOINT is set and an OTLP exporter is installed.
    """
    name = os.environ.get("OTEL_SERVICE_NAME", service)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set but no OTLP exporter is installed; "
                "spans are not exported",
                extra={"endpoint": endpoint},
            )
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer("hopline")


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def outgoing_metadata(extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current trace context to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) + extra


class ServerTracingInterceptor(UnaryInterceptor):
    """Opens a server span per unary RPC, parented on the caller's `traceparent`."""

    def wrap(
        self, method: str, details: grpc.HandlerCallDetails, inner: Behaviour
    ) -> Behaviour | None:
        parent = propagate.extract({k: v for k, v in details.invocation_metadata or ()})

        async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with tracer().start_as_current_span(
                method.lstrip("/"),
                context=parent,
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": method},
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    return await inner(request, context)
                finally:
                    code = context.code()
                    if code not in (None, grpc.StatusCode.OK):
                        span.set_status(Status(StatusCode.ERROR, str(code)))

        return traced
