"""Which traces a process records: hopline's default ratio at the root when exporting, none
when not, the parent's decision everywhere else, the standard OTEL_TRACES_SAMPLER when set;
and no spans at all below a root that is not recorded."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from opentelemetry import propagate
from opentelemetry.context import Context, attach, detach
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace import use_span as trace_use_span

from hopline.observability import tracing
from hopline.observability.tracing import (
    EXPORT_SAMPLE_RATIO,
    ServerTracing,
    child_span,
    default_sampler,
    names_unsampled_current,
    outgoing_metadata,
)


def _parent(sampled: bool) -> object:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    context = SpanContext(trace_id=7, span_id=9, is_remote=True, trace_flags=flags)
    return set_span_in_context(NonRecordingSpan(context))


def test_roots_keep_the_default_ratio_and_children_follow_their_parent() -> None:
    sampler = default_sampler(True, {})
    assert sampler is not None
    # Trace ids spread over the whole 128 bits, as the SDK's generator makes them.
    trace_ids = [i * 0x9E3779B97F4A7C15 % (1 << 128) for i in range(1, 20_001)]
    kept = sum(
        sampler.should_sample(None, t, "root").decision == Decision.RECORD_AND_SAMPLE
        for t in trace_ids
    )
    assert abs(kept / 20_000 - EXPORT_SAMPLE_RATIO) < 0.02
    for sampled in (True, False):
        decision = sampler.should_sample(_parent(sampled), 7, "child").decision  # type: ignore[arg-type]
        assert (decision == Decision.RECORD_AND_SAMPLE) is sampled


def test_nothing_is_recorded_without_export_and_the_standard_variable_wins() -> None:
    quiet = default_sampler(False, {})
    assert quiet is not None
    assert quiet.should_sample(None, 7, "root").decision == Decision.DROP
    assert default_sampler(True, {"OTEL_TRACES_SAMPLER": "parentbased_always_on"}) is DEFAULT_ON
    assert default_sampler(False, {"OTEL_TRACES_SAMPLER": "always_on"}) is ALWAYS_ON


@pytest.mark.parametrize(
    ("environ", "ratio"),
    [
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            0.25,
        ),
        ({"OTEL_TRACES_SAMPLER": "TraceIdRatio ", "OTEL_TRACES_SAMPLER_ARG": " 0 "}, 0.0),
        ({"OTEL_TRACES_SAMPLER": "traceidratio"}, 1.0),  # the specification's default
    ],
)
def test_a_ratio_sampler_keeps_the_share_its_argument_names(
    environ: dict[str, str], ratio: float
) -> None:
    sampler = default_sampler(True, environ)
    root = getattr(sampler, "_root", sampler)  # ParentBased's sampler for roots
    assert isinstance(root, TraceIdRatioBased)
    assert root.rate == ratio


@pytest.mark.parametrize(
    ("environ", "said"),
    [
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
            "OTEL_TRACES_SAMPLER_ARG='1.5' is not a share of traces from 0 to 1",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1O"},
            "OTEL_TRACES_SAMPLER_ARG='0.1O' is not a share of traces from 0 to 1",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "nan"},
            "OTEL_TRACES_SAMPLER_ARG='nan'",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "-0.1"},
            "OTEL_TRACES_SAMPLER_ARG='-0.1'",
        ),
        ({"OTEL_TRACES_SAMPLER": "bogus"}, "OTEL_TRACES_SAMPLER='bogus' is not a sampler"),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidration"}, "parentbased_jaeger_remote"),
    ],
)
def test_a_sampler_setting_the_sdk_would_ignore_is_refused(
    environ: dict[str, str], said: str
) -> None:
    """The SDK logged one warning for these and kept every trace: a typo exported them all."""
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER") as refused:
        default_sampler(True, environ)
    assert said in str(refused.value)


def test_setup_tracing_refuses_a_sampler_typo_rather_than_keep_every_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `hopline serve` calls (cli/main.py turns the ValueError into exit 2)."""
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "1.5")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        tracing.setup_tracing("gateway")


def _recorder(monkeypatch: pytest.MonkeyPatch, sampler: Sampler) -> InMemorySpanExporter:
    """hopline's tracer on a provider with `sampler` whose spans end up in the returned list
    (the tracer is looked up once per process; this stands in for it)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    return exporter


@pytest.mark.parametrize("sampled", [True, False])
def test_a_hop_in_an_unrecorded_trace_opens_no_span_and_keeps_the_trace_id(
    monkeypatch: pytest.MonkeyPatch, sampled: bool
) -> None:
    """A request the root sampled out: its hops' client and server spans would be dropped, so
    none are made, but the next hop still gets the request's trace id (logs, replies)."""
    exporter = _recorder(monkeypatch, default_sampler(True, {}) or ALWAYS_OFF)
    seen: list[tuple[int, bool]] = []

    async def servicer(request: str, context: object) -> str:
        current = get_current_span().get_span_context()
        seen.append((current.trace_id, current.trace_flags.sampled))
        return request

    behaviour = ServerTracing().wrap("/hopline.test.v1.Test/Echo", servicer)
    parent = _parent(sampled)

    async def scenario() -> None:
        token = attach(cast(Context, parent))
        try:
            with child_span("hop", kind=SpanKind.CLIENT):
                await behaviour("hi", cast(Any, _Metadata(outgoing_metadata())))
        finally:
            detach(token)

    asyncio.run(scenario())
    assert seen == [(7, sampled)]
    spans = exporter.get_finished_spans()
    assert sorted(s.kind.name for s in spans) == (["CLIENT", "SERVER"] if sampled else [])
    if sampled:
        server = next(s for s in spans if s.kind == SpanKind.SERVER)
        client = next(s for s in spans if s.kind == SpanKind.CLIENT)
        assert server.parent is not None
        assert server.parent.span_id == client.context.span_id


def test_a_root_without_a_parent_gets_ids_even_when_not_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No exporter: the gateway's root span is not recorded, yet its reply's trace id and its
    hops' traceparent come from it."""
    exporter = _recorder(monkeypatch, ALWAYS_OFF)
    seen: list[SpanContext] = []

    async def servicer(request: str, context: object) -> str:
        with child_span("hop"):
            seen.append(get_current_span().get_span_context())
        return request

    behaviour = ServerTracing().wrap("/hopline.test.v1.Test/Echo", servicer)

    async def scenario() -> None:
        await behaviour("hi", cast(Any, _Metadata(())))

    asyncio.run(scenario())
    (root,) = seen
    assert root.is_valid
    assert not root.trace_flags.sampled
    assert exporter.get_finished_spans() == ()


class _Metadata:
    """The part of a servicer context ServerTracing reads."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def code(self) -> None:
        return None

    def time_remaining(self) -> None:
        return None


def test_a_callee_runs_under_the_context_its_metadata_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An in-process call whose metadata names the current span runs in the caller's context
    as it is; one whose metadata names another request's (a stage batch sent from another
    request's task) runs under that one, as a remote callee would."""
    _recorder(monkeypatch, default_sampler(True, {}) or ALWAYS_OFF)
    seen: list[int] = []

    async def servicer(request: str, context: object) -> str:
        seen.append(get_current_span().get_span_context().span_id)
        return request

    behaviour = ServerTracing().wrap("/hopline.test.v1.Test/Echo", servicer)
    mine = NonRecordingSpan(SpanContext(7, 9, is_remote=False))
    other = NonRecordingSpan(SpanContext(7, 11, is_remote=False))

    async def scenario() -> None:
        token = attach(set_span_in_context(mine))
        try:
            await behaviour("hi", cast(Any, _Metadata(outgoing_metadata())))
            with trace_use_span(other):
                theirs = outgoing_metadata()
            await behaviour("hi", cast(Any, _Metadata(theirs)))
            await behaviour("hi", cast(Any, _Metadata((*theirs, ("baggage", "k=v")))))
        finally:
            detach(token)

    asyncio.run(scenario())
    assert seen == [9, 11, 11]


def test_outgoing_metadata_follows_the_current_context() -> None:
    """Each context's own traceparent, as the propagator writes it, also when contexts
    alternate (the injection is remembered for the last context only)."""
    spans = [
        NonRecordingSpan(SpanContext(7, s, is_remote=False, trace_flags=TraceFlags(f)))
        for s, f in ((9, 0), (11, 1), (9, 1))
    ]
    for span in (*spans, *spans):
        token = attach(set_span_in_context(span))
        try:
            expected: dict[str, str] = {}
            propagate.inject(expected)
            assert outgoing_metadata() == tuple(expected.items())
            assert outgoing_metadata((("x", "y"),)) == (*expected.items(), ("x", "y"))
        finally:
            detach(token)


def test_the_sdks_own_unrecorded_span_is_recognised_in_its_callees_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spans the SDK itself makes, not hand-built contexts: this SDK sets the random-trace-id
    flag (0x02) on every span, so its traceparent ends `-02` for a trace it does not record.
    An in-process callee under such a span runs without extracting its metadata; under a
    recorded span, or with another span's metadata, it extracts."""
    extracted: list[object] = []
    real_extract = propagate.extract

    def counting_extract(*args: Any, **kwargs: Any) -> Context:
        extracted.append(args)
        return real_extract(*args, **kwargs)

    monkeypatch.setattr(propagate, "extract", counting_extract)  # tracing.py calls it so
    behaviour = ServerTracing().wrap("/hopline.test.v1.Test/Echo", _echo)
    unrecorded = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    recorded = TracerProvider().get_tracer("test")

    async def scenario() -> None:
        with unrecorded.start_as_current_span("caller") as caller:
            assert caller.get_span_context().trace_flags == 0x02  # random, not sampled
            metadata = outgoing_metadata()
            assert names_unsampled_current(metadata, caller.get_span_context())
            await behaviour("hi", cast(Any, _Metadata(metadata)))
            assert extracted == []
            with unrecorded.start_as_current_span("another"):
                theirs = outgoing_metadata()
            await behaviour("hi", cast(Any, _Metadata(theirs)))
            assert len(extracted) == 1
        with recorded.start_as_current_span("sampled") as sampled:
            metadata = outgoing_metadata()
            assert not names_unsampled_current(metadata, sampled.get_span_context())
            await behaviour("hi", cast(Any, _Metadata(metadata)))
            assert len(extracted) == 2

    asyncio.run(scenario())


async def _echo(request: str, context: object) -> str:
    return request


@pytest.mark.parametrize("recorded", [False, True])
def test_an_rpc_leaves_the_context_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch, recorded: bool
) -> None:
    """Whichever way the server span came (a root of its own, an unrecorded caller's context
    attached, the current context kept), the context is the caller's again after the RPC,
    also when the servicer fails; each recorded root span is ended once."""
    exporter = _recorder(monkeypatch, ParentBased(ALWAYS_ON) if recorded else ALWAYS_OFF)

    async def failing(request: str, context: object) -> str:
        raise ValueError("broken")

    outer = NonRecordingSpan(SpanContext(5, 6, is_remote=False))
    elsewhere: dict[str, str] = {}
    propagate.inject(elsewhere, context=cast(Context, _parent(False)))

    async def scenario() -> None:
        token = attach(set_span_in_context(outer))
        try:
            for servicer in (_echo, failing):
                behaviour = ServerTracing().wrap("/hopline.test.v1.Test/Echo", servicer)
                for metadata in ((), outgoing_metadata(), tuple(elsewhere.items())):
                    try:
                        await behaviour("hi", cast(Any, _Metadata(metadata)))
                    except ValueError:
                        assert servicer is failing
                    assert get_current_span() is outer
        finally:
            detach(token)

    asyncio.run(scenario())
    servers = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    # Recorded: the two roots (no metadata); the other calls' callers are not recorded.
    assert len(servers) == (2 if recorded else 0)
    assert all(s.parent is None and s.end_time for s in servers)


@pytest.mark.parametrize(
    ("sampler", "parent_decides", "spans"),
    [(ALWAYS_ON, False, 1), (DEFAULT_ON, True, 0)],
)
def test_a_callers_unsampled_trace_is_followed_only_by_a_sampler_that_follows_it(
    monkeypatch: pytest.MonkeyPatch, sampler: Sampler, parent_decides: bool, spans: int
) -> None:
    """`always_on` (and `jaeger_remote` without the prefix) ignore a caller's decision: a
    request with an unsampled `traceparent` got no span all the same (a tracing probe), since
    the server took such a caller's decision without asking the sampler."""
    exporter = _recorder(monkeypatch, sampler)
    monkeypatch.setattr(tracing, "_PARENT_DECIDES", parent_decides)

    async def servicer(request: str, context: object) -> str:
        return request

    behaviour = ServerTracing().wrap("/hopline.test.v1.Test/Echo", servicer)
    caller = (("traceparent", f"00-{7:032x}-{9:016x}-00"),)

    async def scenario() -> None:
        await behaviour("hi", cast(Any, _Metadata(caller)))

    asyncio.run(scenario())
    assert len(exporter.get_finished_spans()) == spans
