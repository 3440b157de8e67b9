"""Which traces a process exports: hopline's default ratio at the root, the parent's decision
everywhere else, and the standard OTEL_TRACES_SAMPLER when set."""

from __future__ import annotations

from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    set_span_in_context,
)

from hopline.observability.tracing import EXPORT_SAMPLE_RATIO, default_sampler


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


def test_no_default_without_export_or_with_the_standard_variable() -> None:
    assert default_sampler(False, {}) is None
    assert default_sampler(True, {"OTEL_TRACES_SAMPLER": "parentbased_always_on"}) is None
