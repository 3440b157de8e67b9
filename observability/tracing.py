"""OpenTelemetry tracing: provider set-up and W3C trace context across gRPC hops.

Every hop gets a server span whose parent comes from the `traceparent` metadata the caller
sent; the gateway opens a client span per upstream call and injects the context. Health and
reflection RPCs are not traced: probes would drown the traces that matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextvars import Token
from typing import Any, cast

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import attach, detach
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from hopline.observability import metrics, schema
from hopline.observability.export_tls import check_export_tls
from hopline.observability.remote_sampling import (
    SAMPLER_NAMES,
    JaegerRemoteSampler,
    RemoteSettings,
)
from hopline.observability.spans import SpanTracerProvider
from hopline.runtime.interceptors import Behaviour, Context, RpcWrapper, StreamBehaviour
from hopline.runtime.service_table import ServiceName

log = logging.getLogger("hopline.tracing")


# Share of traces exported when OTEL_TRACES_SAMPLER is unset (see setup_tracing).
EXPORT_SAMPLE_RATIO = 0.1


# The SDK's named samplers (OpenTelemetry's OTEL_TRACES_SAMPLER values): the SDK itself
# takes any other name, or a ratio that is not one, with a warning and keeps every trace,
# so a typo in a production setting would have exported all of them.
_FIXED_SAMPLERS: dict[str, Sampler] = {
    "always_on": ALWAYS_ON,
    "always_off": ALWAYS_OFF,
    "parentbased_always_on": DEFAULT_ON,
    "parentbased_always_off": DEFAULT_OFF,
}
_RATIO_SAMPLERS = {
    "traceidratio": TraceIdRatioBased,
    "parentbased_traceidratio": ParentBasedTraceIdRatio,
}
SAMPLERS = (*_FIXED_SAMPLERS, *_RATIO_SAMPLERS, *SAMPLER_NAMES)


def default_sampler(
    exporting: bool, environ: Mapping[str, str], service: str = "", *, edge: bool = True
) -> Sampler:
    """The sampler OTEL_TRACES_SAMPLER names, else hopline's.

    Exporting: the root keeps EXPORT_SAMPLE_RATIO of traces and every other process follows
    its decision. Not exporting: nothing is recorded, since nothing would read it; spans
    still get ids, so replies and logs carry a trace id. Recording spans that nobody exports
    cost about 1 ms of a one-process miss's p50 (README.md "Traces and metrics").
    `jaeger_remote` and `parentbased_jaeger_remote` are ours (remote_sampling.py), not the
    SDK's. ValueError names the variable for a sampler that is none of SAMPLERS or an
    OTEL_TRACES_SAMPLER_ARG its sampler cannot take, where the SDK would keep every trace."""
    named = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    argument = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if named in SAMPLER_NAMES:
        settings = RemoteSettings.parse(argument, EXPORT_SAMPLE_RATIO)
        remote = JaegerRemoteSampler(service, settings, edge=edge)
        return ParentBased(remote) if named.startswith("parentbased") else remote
    if named in _FIXED_SAMPLERS:
        return _FIXED_SAMPLERS[named]
    if named in _RATIO_SAMPLERS:
        return _RATIO_SAMPLERS[named](_sampler_ratio(named, argument))
    if named:
        raise ValueError(
            f"OTEL_TRACES_SAMPLER={environ['OTEL_TRACES_SAMPLER']!r} is not a sampler: "
            f"one of {', '.join(SAMPLERS)}"
        )
    return ParentBased(TraceIdRatioBased(EXPORT_SAMPLE_RATIO)) if exporting else ALWAYS_OFF


def _sampler_ratio(named: str, argument: str) -> float:
    """The share of traces a ratio sampler keeps: 1 when unset, as the specification says."""
    if not argument:
        return 1.0
    try:
        ratio = float(argument)
    except ValueError:
        ratio = math.nan
    if not 0.0 <= ratio <= 1.0:  # NaN too
        raise ValueError(
            f"OTEL_TRACES_SAMPLER_ARG={argument!r} is not a share of traces from 0 to 1, "
            f"which OTEL_TRACES_SAMPLER={named} takes"
        )
    return ratio


def remote_sampler(sampler: Sampler) -> JaegerRemoteSampler | None:
    """The Jaeger remote sampler deciding for roots under `sampler`, if it is one."""
    root = getattr(sampler, "_root", sampler)  # ParentBased's sampler for roots
    return root if isinstance(root, JaegerRemoteSampler) else None


def unsampled(context: SpanContext) -> bool:
    """A trace that is not recorded: every span under it would be dropped too."""
    return context.is_valid and not context.trace_flags.sampled


def names_unsampled_current(metadata: Iterable[tuple[str, Any]], current: SpanContext) -> bool:
    """Whether `metadata` carries nothing but a `traceparent` naming `current`, a span of a
    trace that is not recorded: what an in-process call made under that span sends.

    Then the callee may run in the current context as it is: extracting the metadata would
    give the same ids (and no baggage or trace state, which would be further entries)."""
    if not unsampled(current):
        return False  # a remote call's handler starts in an empty context: never here
    traceparent = None
    for i, (key, value) in enumerate(metadata):
        if i or key != _TRACEPARENT:
            return False
        traceparent = value
    return traceparent == _traceparent(current)


_TRACEPARENT = "traceparent"


def _traceparent(context: SpanContext) -> str:
    """W3C trace context version 00 with the span's own flags, as the SDK injects it. This
    SDK (1.45) marks every span's trace id random (flag 0x02, trace context level 2), sampled
    or not: a fixed `-00` here had never matched one of its spans, so every in-process call
    took the extract path (measured after the fix, co-located c=32, switched inside one
    gateway, 2 meshes x 3 rounds: no change in the loop's CPU a request, +0.028 ms median,
    or in throughput; the path was meant to save microseconds, and at c=32 it does not show)."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def child_span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    quiet: bool = False,
    links: Sequence[trace.Link] = (),
) -> contextlib.AbstractContextManager[trace.Span]:
    """A span under the current one, or, in a trace that is not recorded, the current
    (non-recording) span itself: making a child there costs a sampler call, ids and a
    context switch per span for nothing. `quiet`: exceptions neither recorded nor mark it."""
    current = trace.get_current_span()
    if unsampled(current.get_span_context()) and not current.is_recording():
        return contextlib.nullcontext(current)
    return tracer().start_as_current_span(
        name,
        kind=kind,
        attributes=attributes,
        links=links,
        record_exception=not quiet,
        set_status_on_exception=not quiet,
    )


# The remote sampler's poller, stopped at shutdown.
_REMOTE: JaegerRemoteSampler | None = None
# Whether the sampler follows a caller's decision (setup_tracing): parent-based, or off.
_PARENT_DECIDES = True
# The service callers outside the mesh reach: where a trace is decided.
EDGE_SERVICE = ServiceName.GATEWAY


def setup_tracing(service: str) -> None:
    """Install the global tracer provider for this process.

    Spans always get ids (the trace id is returned to clients). They are exported over
    OTLP/gRPC through a batch processor when OTEL_EXPORTER_OTLP_ENDPOINT (or the traces-only
    variant) is set; the standard OTEL_* variables configure the exporter, the batch
    processor and the sampler. With no endpoint nothing is exported and nothing is recorded
    (default_sampler).

    When exporting with no OTEL_TRACES_SAMPLER set, the root of a trace (the gateway, for a
    client that sends no `traceparent`) keeps EXPORT_SAMPLE_RATIO of traces and every other
    process follows its decision, so a trace is whole or absent. Measured in README.md
    "Traces and metrics": exporting every trace cost the mesh more than the issue's budget; a
    sampled-out request gets no spans below its root (`child_span`, `ServerTracing`). A
    client that wants one request traced sends a sampled `traceparent`;
    OTEL_TRACES_SAMPLER=parentbased_always_on keeps all. A kept trace's spans are
    `spans.py:RecordedSpan`s, encoded by `otlp.py`: a fraction of the SDK's span's cost.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        trace.set_tracer_provider(trace.NoOpTracerProvider())  # no spans, no trace ids
        return
    name = os.environ.get("OTEL_SERVICE_NAME", service)
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    exporting = bool(endpoint) and os.environ.get("OTEL_TRACES_EXPORTER", "otlp") != "none"
    # Before anything starts: a TLS setting that cannot work fails the start (ValueError).
    tls = check_export_tls(os.environ, endpoint or "") if exporting else None
    if exporting:
        check_export_settings(os.environ)
    sampler = default_sampler(exporting, os.environ, name, edge=service == EDGE_SERVICE)
    global _REMOTE, _PARENT_DECIDES
    # A caller's trace that is not recorded is followed without a sampler call only where the
    # sampler would follow it: `always_on` or `jaeger_remote` without the prefix ignore it,
    # and such requests got no span at all (a tracing probe).
    _PARENT_DECIDES = isinstance(sampler, ParentBased) or sampler is ALWAYS_OFF
    _REMOTE = remote_sampler(sampler)
    if _REMOTE is not None:
        _REMOTE.start()
        log.info("sampling from Jaeger", extra={"url": _REMOTE.url})
    processor: Any = None
    exporter: Any = None
    if exporting:
        # Imported only when exporting: they pull in the OTLP protobufs.
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from hopline.observability.otlp import OtlpSpanExporter

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
        # GIL for each span, so a 512-span batch stalls the event loop for milliseconds.
        # Measured with bench/scripts/tracing_overhead.py: added p99 +14 ms at 512/1 s, +5 ms
        # at 64/200 ms (with the SDK's encoder, about twice otlp.py's cost per span).
        batch = int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64"))
        delay_ms = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "200"))
        exporter = OtlpSpanExporter(Resource.create({"service.name": name}), tls, endpoint or "")
        processor = BatchSpanProcessor(
            exporter, max_export_batch_size=batch, schedule_delay_millis=delay_ms
        )
        log.info(
            "exporting spans",
            extra={
                "endpoint": endpoint,
                "service_name": name,
                "tls": tls.mode if tls else "off",
                "sampler": sampler.get_description(),
            },
        )
    trace.set_tracer_provider(SpanTracerProvider(sampler, processor, exporter))


# The batch processor's settings: (variable, integer?, the value must be above this). The
# SDK refused a delay of 0 too, naming nothing (a reviewer's probe).
_BSP_SETTINGS = (
    ("OTEL_BSP_MAX_QUEUE_SIZE", True, 0),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", True, 0),
    ("OTEL_BSP_SCHEDULE_DELAY", False, 0),
    ("OTEL_BSP_EXPORT_TIMEOUT", False, -1),
)
SDK_QUEUE_SIZE = 2048  # the SDK's OTEL_BSP_MAX_QUEUE_SIZE when unset


def check_export_settings(environ: Mapping[str, str]) -> None:
    """ValueError naming the variable for an export setting that cannot work: the SDK's own
    message named none ("could not convert string to float: 'abc'", "max_queue_size must be a
    positive integer."), and an endpoint's port past 65535 exported to that port modulo
    65536, another listener's (an observability probe)."""
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = environ.get(variable, "").strip()
        if not endpoint:
            continue
        try:  # a port out of range, or not a number, is ValueError here
            port = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").port
        except ValueError:
            port = 0
        if port == 0:
            raise ValueError(f"{variable}={endpoint!r}: the port must be 1 to 65535")
        break  # the traces-only variable wins when set
    values: dict[str, float] = {}
    for variable, whole, above in _BSP_SETTINGS:
        raw = environ.get(variable)
        if raw is None:
            continue
        try:
            values[variable] = int(raw) if whole else float(raw)
        except ValueError:
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"{variable}={raw!r}: must be {kind}") from None
        if values[variable] <= above:
            least = "positive" if above == 0 else f"above {above}"
            raise ValueError(f"{variable}={raw!r}: must be {least}")
    batch = values.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
    queue = values.get("OTEL_BSP_MAX_QUEUE_SIZE", SDK_QUEUE_SIZE)
    if batch is not None and batch > queue:
        raise ValueError(
            f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={int(batch)} is above OTEL_BSP_MAX_QUEUE_SIZE "
            f"({int(queue)}): a batch is taken from the queue"
        )


def shutdown_tracing() -> None:
    """Flush spans still queued for export; called once the service has drained."""
    if _REMOTE is not None:
        _REMOTE.stop()
    provider = trace.get_tracer_provider()
    if isinstance(provider, SpanTracerProvider):
        provider.shutdown()


_TRACER: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    """hopline's tracer, from the provider installed by `setup_tracing` (looked up once)."""
    global _TRACER
    if _TRACER is None:
        _TRACER = trace.get_tracer("hopline")
    return _TRACER


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


@contextlib.contextmanager
def in_context(context: otel_context.Context) -> Iterator[trace.Span]:
    """Run under `context` (its span current), opening no span of our own."""
    token = attach(context)
    try:
        yield trace.get_current_span()
    finally:
        detach(token)


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Run with a current span of a trace that is not recorded: for a process's own
    periodic work (a model list re-read every few seconds), which is no request's and would
    otherwise start a root trace every time, on this side and, through the `traceparent` it
    sends, on the callee's (a parent-based sampler keeps a root trace at its ratio, every
    one with `parentbased_always_on`). Spans opened with `child_span` are then none at all."""
    span = trace.NonRecordingSpan(
        SpanContext(
            trace_id=random.getrandbits(128) or 1,
            span_id=random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT),
        )
    )
    token = attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        detach(token)


Carried = tuple[tuple[str, str], ...]
# The last context injected and what it gave. Contexts are immutable, so the same object
# always injects the same metadata; a request's hops made under one span (every hop of a
# trace that is not recorded) then pay for one injection.
_last_injected: tuple[otel_context.Context | None, Carried] = (None, ())


def outgoing_metadata(extra: Carried = ()) -> Carried:
    """gRPC metadata carrying the current trace context to the next hop."""
    global _last_injected
    current = otel_context.get_current()
    injected_from, carried = _last_injected
    if injected_from is not current:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=current)
        carried = tuple(carrier.items())
        _last_injected = (current, carried)
    return carried + extra if extra else carried


_Token = Token[otel_context.Context]


class ServerTracing(RpcWrapper):
    """A server span per RPC, parented on the caller's `traceparent`, and the RPC's latency
    histogram and in-flight gauge, observed inside the span so the exemplar carries its trace
    id.

    A streaming RPC gets one span from its start to its last message (the opentelemetry grpc
    aio instrumentation ends it too early or not at all for streams, so this is our own), with
    the messages counted; per-message work opens child spans under it. Everything that does
    not change per call (names, attributes, metric children) is resolved once per method.
    """

    def __init__(self, test_delay_ms: float = 0.0) -> None:
        self.test_delay_s = test_delay_ms / 1e3

    def _rpc(self, method: str) -> _TracedRpc:
        return _TracedRpc(method, self.test_delay_s)

    def wrap(self, method: str, inner: Behaviour) -> Behaviour:
        rpc = self._rpc(method)

        async def traced(request: Any, context: Context) -> Any:
            span, token, own = rpc.start(context)
            code: grpc.StatusCode | None = None
            started = time.perf_counter()
            try:
                if rpc.test_delay_s:
                    await rpc.delay(span)
                return await inner(request, context)
            except asyncio.CancelledError:
                code = _cancelled_code(context)
                raise
            except Exception as exc:
                code = _failed_code(span, context, exc)
                raise
            finally:
                rpc.finish(span, context, code, started)
                _stop(span, token, own)

        return traced

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        rpc = self._rpc(method)

        async def traced(request: Any, context: Context) -> AsyncIterator[Any]:
            span, token, own = rpc.start(context)
            code: grpc.StatusCode | None = None
            started = time.perf_counter()
            sent = 0
            try:
                if rpc.test_delay_s:
                    await rpc.delay(span)
                async for reply in inner(request, context):
                    sent += 1
                    yield reply
            except asyncio.CancelledError:  # the client went away, or its deadline passed
                code = _cancelled_code(context)
                raise
            except GeneratorExit:
                # grpc closed the stream's generator under us (its client went away between
                # two replies): cancelled, not OK. The close runs in grpc's context, not the
                # one the span was attached in, so that one is not restored here (detaching
                # there failed and logged an error).
                code, token = _cancelled_code(context), None
                raise
            except Exception as exc:
                code = _failed_code(span, context, exc)
                raise
            finally:
                span.set_attribute(schema.STREAM_MESSAGES_SENT, sent)
                rpc.finish(span, context, code, started)
                _stop(span, token, own)

        return traced


def _stop(span: trace.Span, token: _Token | None, own: bool) -> None:
    """Undo `_TracedRpc.start`: end the RPC's own span, restore the context it replaced."""
    if own:
        span.end()
    if token is not None:
        detach(token)


# The propagator's header names, by the propagator they were read from (OTEL_PROPAGATORS
# may replace it at start-up).
_fields: tuple[object, frozenset[str]] = (None, frozenset())
_NO_CONTEXT = otel_context.Context()

# The codes that mean the server failed (OpenTelemetry's RPC conventions for gRPC servers).
# The others answer the caller's own request (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED,
# RESOURCE_EXHAUSTED, CANCELLED...): an ERROR there would have the tail sampler keep every
# trace a misbehaving client sends and show its mistakes as the server's errors in Jaeger.
# The code itself is on every span (rpc.grpc.status_code), so they stay searchable.
SERVER_FAILURES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def server_failed(code: grpc.StatusCode) -> bool:
    """Whether a server span that answered `code` is an error (see SERVER_FAILURES)."""
    return code in SERVER_FAILURES


def _carries_context(metadata: Iterable[tuple[str, Any]]) -> bool:
    """Whether the caller sent trace context (else there is nothing to parse)."""
    global _fields
    textmap = propagate.get_global_textmap()
    if _fields[0] is not textmap:
        _fields = (textmap, frozenset(textmap.fields))
    fields = _fields[1]
    return any(key in fields for key, _ in metadata)


# A client's timer ends its call when its deadline passes; this side's deadline, counted from
# the call's arrival, passes a little later: a cancel this close to it is the deadline's.
DEADLINE_SLACK_S = 0.005


def _cancelled_code(context: Context) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED for a call cancelled by its deadline (the client's own timer
    included: counted as CANCELLED, 3 of 30 Predicts ended by a client deadline were),
    CANCELLED for one its caller gave up."""
    remaining = cast("float | None", context.time_remaining())
    expired = remaining is not None and remaining <= DEADLINE_SLACK_S
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


def _failed_code(span: trace.Span, context: Context, exc: Exception) -> grpc.StatusCode | None:
    """The status of a handler that raised: None where it aborted (the context has the
    code), else UNKNOWN, which is what gRPC sends its caller for an exception it did not
    expect; the span records that exception, since nothing else on the server does."""
    if context.code() is not None:
        return None
    span.record_exception(exc)
    return grpc.StatusCode.UNKNOWN


class RpcMeter:
    """One method's server metrics: its calls in flight and their latency by status (the
    children resolved once per method and status)."""

    def __init__(self, method: str) -> None:
        self.service, _, self.method = method.lstrip("/").rpartition("/")
        self._in_flight = metrics.RPC_IN_FLIGHT.labels(self.service, self.method)
        self._durations: dict[grpc.StatusCode, Any] = {}

    def enter(self) -> None:
        self._in_flight.inc()

    def leave(
        self, code: grpc.StatusCode, started: float, exemplar: dict[str, str] | None = None
    ) -> None:
        """A call that started at `started` (time.perf_counter) ended with `code`."""
        self._in_flight.dec()
        histogram = self._durations.get(code)
        if histogram is None:
            histogram = self._durations[code] = metrics.RPC_DURATION.labels(
                self.service, self.method, code.name
            )
        histogram.observe(time.perf_counter() - started, exemplar)


class _TracedRpc:
    """One method's span name, attributes and metric children."""

    def __init__(self, method: str, test_delay_s: float) -> None:
        self.name = method.lstrip("/")
        service, _, rpc_method = self.name.rpartition("/")
        self.service, self.method = service, rpc_method
        self.attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method}
        self.meter = RpcMeter(self.name)
        self.test_delay_s = test_delay_s

    def start(self, context: Context) -> tuple[trace.Span, _Token | None, bool]:
        """The RPC's span, the token that made its context current (None: it already was),
        and whether the span is the RPC's own, to end with it.

        Plain calls, no context managers: this runs on every RPC of every service, and
        the generator-based managers the API offers (`start_as_current_span`, `use_span`)
        cost more than the rest of it together (`_stop` undoes it)."""
        metadata = context.invocation_metadata() or ()
        self.meter.enter()
        if _carries_context(metadata):
            current = trace.get_current_span()
            if names_unsampled_current(metadata, current.get_span_context()):
                # An in-process caller whose trace is not recorded: the RPC already runs in
                # the context its metadata names, so there is nothing to parse or attach.
                return current, None, False
            parent = propagate.extract(dict(metadata))
            caller = trace.get_current_span(parent)
            if _PARENT_DECIDES and unsampled(caller.get_span_context()):
                # The caller's trace is not recorded: the RPC runs in its context (logs and
                # the next hop keep its trace id) with no span of its own.
                return caller, attach(parent), False
        else:
            parent = _NO_CONTEXT  # a client's call: this RPC is the trace's root
        span = tracer().start_span(
            self.name, context=parent, kind=SpanKind.SERVER, attributes=self.attributes
        )
        return span, attach(trace.set_span_in_context(span, parent)), True

    async def delay(self, span: trace.Span) -> None:
        """HOPLINE_TEST_DELAY_MS: a slow hop on purpose, for tests and demos."""
        if self.test_delay_s > 0:
            span.set_attribute(schema.DELAY_MS, self.test_delay_s * 1e3)
            await asyncio.sleep(self.test_delay_s)

    def finish(
        self,
        span: trace.Span,
        context: Context,
        code: grpc.StatusCode | None,
        started: float,
    ) -> None:
        # None until the handler sets a code, whatever the stubs say.
        code = code or cast("grpc.StatusCode | None", context.code()) or grpc.StatusCode.OK
        if server_failed(code):
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        self.meter.leave(code, started, metrics.span_exemplar(span))
