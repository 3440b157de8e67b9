"""OpenTelemetry tracing: provider set-up and W3C trace context across gRPC hops.

Every hop gets a server span whose parent comes from the `traceparent` metadata the caller
sent; the gateway opens a client span per upstream call and injects the context. Health and
reflection RPCs are not traced: probes would drown the traces that matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from hopline.interceptors import Behaviour, Context, RpcInterceptor, StreamBehaviour
from hopline.observability import metrics, schema

log = logging.getLogger("hopline.tracing")


def setup_tracing(service: str) -> None:
    """Install the global tracer provider for this process.

    Spans always get ids (the trace id is returned to clients). They are exported over
    OTLP/gRPC through a batch processor when OTEL_EXPORTER_OTLP_ENDPOINT (or the traces-only
    variant) is set; the standard OTEL_* variables configure the exporter, the batch
    processor and the sampler. With no endpoint nothing is exported and the spans cost only
    their creation.
    """
    name = os.environ.get("OTEL_SERVICE_NAME", service)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint and os.environ.get("OTEL_TRACES_EXPORTER", "otlp") != "none":
        # Imported only when exporting: it pulls in the OTLP protobufs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        )
        if protocol not in (None, "grpc"):
            # The HTTP exporter is not a dependency (it measured no cheaper here); sending
            # gRPC to an OTLP/HTTP port (4318) would lose every span without a word.
            log.warning(
                "only OTLP/gRPC export is supported; exporting over gRPC",
                extra={"OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "endpoint": endpoint},
            )
        # Smaller, more frequent batches than the SDK's (512 spans, 5 s): encoding holds the
        # GIL for about 30 us a span, so a 512-span batch stalls the event loop for ~15 ms.
        # Measured with bench/scripts/tracing_overhead.py: added p99 +14 ms at 512/1 s, +5 ms
        # at 64/200 ms.
        batch = int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64"))
        delay_ms = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "200"))
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(), max_export_batch_size=batch, schedule_delay_millis=delay_ms
            )
        )
        log.info("exporting spans", extra={"endpoint": endpoint, "service_name": name})
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    """Flush spans still queued for export; called once the service has drained."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


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


class ServerTracingInterceptor(RpcInterceptor):
    """A server span per RPC, parented on the caller's `traceparent`, and the RPC's latency
    histogram and in-flight gauge, observed inside the span so the exemplar carries its trace
    id.

    A streaming RPC gets one span from its start to its last message (the opentelemetry grpc
    aio instrumentation ends it too early or not at all for streams, so this is our own), with
    the messages counted; per-message work opens child spans under it.
    """

    def __init__(self, test_delay_ms: float = 0.0) -> None:
        self.test_delay_s = test_delay_ms / 1e3

    @contextlib.asynccontextmanager
    async def _span(
        self, method: str, details: grpc.HandlerCallDetails, context: Context
    ) -> AsyncIterator[trace.Span]:
        parent = propagate.extract({k: v for k, v in details.invocation_metadata or ()})
        service, _, name = method.lstrip("/").rpartition("/")
        in_flight = metrics.RPC_IN_FLIGHT.labels(service, name)
        with tracer().start_as_current_span(
            method.lstrip("/"),
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            started = time.perf_counter()
            in_flight.inc()
            # None until the handler sets a code, whatever the stubs say.
            code: grpc.StatusCode | None = None
            try:
                if self.test_delay_s > 0:
                    span.set_attribute(schema.DELAY_MS, self.test_delay_s * 1e3)
                    await asyncio.sleep(self.test_delay_s)
                yield span
            except asyncio.CancelledError:  # the client went away, or its deadline passed
                remaining = cast("float | None", context.time_remaining())
                expired = remaining is not None and remaining <= 0
                code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                raise
            finally:
                in_flight.dec()
                code = code or cast("grpc.StatusCode | None", context.code()) or grpc.StatusCode.OK
                if code is not grpc.StatusCode.OK:
                    span.set_status(Status(StatusCode.ERROR, code.name))
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                metrics.RPC_DURATION.labels(service, name, code.name).observe(
                    time.perf_counter() - started, metrics.trace_exemplar()
                )

    def wrap(
        self, method: str, details: grpc.HandlerCallDetails, inner: Behaviour
    ) -> Behaviour | None:
        async def traced(request: Any, context: Context) -> Any:
            async with self._span(method, details, context):
                return await inner(request, context)

        return traced

    def wrap_stream(
        self, method: str, details: grpc.HandlerCallDetails, inner: StreamBehaviour
    ) -> StreamBehaviour | None:
        async def traced(request: Any, context: Context) -> AsyncIterator[Any]:
            async with self._span(method, details, context) as span:
                sent = 0
                try:
                    async for reply in inner(request, context):
                        sent += 1
                        yield reply
                finally:
                    span.set_attribute(schema.STREAM_MESSAGES_SENT, sent)

        return traced
