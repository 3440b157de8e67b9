"""Jaeger remote sampling (observability/remote_sampling.py): the settings and strategies as
Jaeger serves them, each strategy's decisions, and what a process does while Jaeger changes
its answer or cannot be reached. Jaeger itself is replaced by a function returning its JSON
here; tests/mesh/test_remote_sampling_jaeger.py runs the real one against a mesh."""

from __future__ import annotations

import http.client
import logging
from typing import Any

import pytest
from fake_clock import FakeClock
from opentelemetry.sdk.trace.sampling import Decision, ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
from prometheus_client import REGISTRY

from hopline.observability.remote_sampling import (
    JaegerRemoteSampler,
    Kept,
    RateLimiter,
    RemoteSettings,
    Rule,
    Strategy,
    parse_strategy,
)
from hopline.observability.tracing import default_sampler, remote_sampler

PREDICT = "hopline.gateway.v1.GatewayService/Predict"
# Trace ids spread over the whole 128 bits, as the SDK's generator makes them.
TRACE_IDS = [i * 0x9E3779B97F4A7C15 % (1 << 128) for i in range(1, 10_001)]


def probabilistic(rate: float) -> dict[str, Any]:
    return {"strategyType": 0, "probabilisticSampling": {"samplingRate": rate}}


def per_operation(default: float, ops: dict[str, float], floor: float = 0.0) -> dict[str, Any]:
    return {
        "strategyType": 0,
        "probabilisticSampling": {"samplingRate": default},
        "operationSampling": {
            "defaultSamplingProbability": default,
            "defaultLowerBoundTracesPerSecond": floor,
            "perOperationStrategies": [
                {"operation": op, "probabilisticSampling": {"samplingRate": r}}
                for op, r in ops.items()
            ],
        },
    }


class FakeJaeger:
    """Answers as Jaeger's HTTP endpoint would, or fails as an unreachable one does."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.urls: list[str] = []

    def __call__(self, url: str) -> Any:
        self.urls.append(url)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def kept(sampler: Any, trace_id: int, name: str = PREDICT) -> bool:
    decision: Decision = sampler.should_sample(None, trace_id, name).decision
    return decision is Decision.RECORD_AND_SAMPLE


def kept_share(sampler: Any, name: str = PREDICT) -> float:
    kept_ = sum(kept(sampler, t, name) for t in TRACE_IDS)
    return float(kept_) / len(TRACE_IDS)


def gauge(operation: str, bound: str) -> float | None:
    return REGISTRY.get_sample_value(
        "hopline_trace_sampling", {"operation": operation, "bound": bound}
    )


def test_settings_read_the_spec_form_and_name_what_is_wrong() -> None:
    settings = RemoteSettings.parse(
        "endpoint=http://jaeger:5778/, pollingIntervalMs=2500,initialSamplingRate=0.25", 0.1
    )
    assert settings == RemoteSettings(0.25, "http://jaeger:5778", 2.5)
    assert RemoteSettings.parse("", 0.1) == RemoteSettings(0.1, "http://localhost:5778", 60.0)
    for arg, words in [
        ("endpoint=jaeger:5778", "not an http URL"),
        ("pollingIntervalMs=0", "above 0"),
        ("pollingIntervalMs=soon", "soon"),
        ("initialSamplingRate=1.5", "0 to 1"),
        ("samplingRate=0.5", "not endpoint="),
        ("endpoint", "not endpoint="),
    ]:
        with pytest.raises(ValueError, match=words):
            RemoteSettings.parse(arg, 0.1)


def test_strategies_parse_as_jaeger_serves_them() -> None:
    assert parse_strategy(probabilistic(0.5)) == Strategy(Rule(0.5))
    named = {"strategyType": "PROBABILISTIC", "probabilisticSampling": {"samplingRate": 0.2}}
    assert parse_strategy(named) == Strategy(Rule(0.2))
    limited = {"strategyType": 1, "rateLimitingSampling": {"maxTracesPerSecond": 5}}
    assert parse_strategy(limited) == Strategy(Rule(0.0, 5.0))
    ops = parse_strategy(per_operation(0.01, {PREDICT: 1.0}, floor=2))
    assert ops == Strategy(Rule(0.01, 2.0), {PREDICT: Rule(1.0, 2.0)})
    assert ops.summary() == f"0.01 of traces, at least 2/s; {PREDICT}: 1 of traces, at least 2/s"
    for bad in [[], probabilistic(2.0), {"strategyType": 7}, {"strategyType": 0}]:
        with pytest.raises((ValueError, KeyError)):
            parse_strategy(bad)


def test_the_default_sampler_builds_the_remote_one_only_when_named() -> None:
    env = {
        "OTEL_TRACES_SAMPLER": "parentbased_jaeger_remote",
        "OTEL_TRACES_SAMPLER_ARG": "endpoint=http://127.0.0.1:1,initialSamplingRate=0",
    }
    wrapped = default_sampler(True, env, "gateway")
    assert isinstance(wrapped, ParentBased)
    remote = remote_sampler(wrapped)
    assert remote is not None
    assert remote.url == "http://127.0.0.1:1/api/sampling?service=gateway"
    # Parent-based: a caller's decision stands whatever the strategy says.
    flags = TraceFlags(TraceFlags.SAMPLED)
    parent = set_span_in_context(NonRecordingSpan(SpanContext(7, 9, True, flags)))
    assert wrapped.should_sample(parent, 7, PREDICT).decision is Decision.RECORD_AND_SAMPLE
    assert wrapped.should_sample(None, 7, PREDICT).decision is Decision.DROP
    alone = default_sampler(True, {**env, "OTEL_TRACES_SAMPLER": "jaeger_remote"}, "gateway")
    assert isinstance(alone, JaegerRemoteSampler)
    assert remote_sampler(alone) is alone
    assert remote_sampler(default_sampler(True, {}, "gateway")) is None
    with pytest.raises(ValueError, match="0 to 1"):
        default_sampler(True, {**env, "OTEL_TRACES_SAMPLER_ARG": "initialSamplingRate=2"})


def test_a_served_strategy_replaces_the_initial_one_and_is_exported() -> None:
    jaeger = FakeJaeger(probabilistic(0.5))
    sampler = JaegerRemoteSampler("gateway", RemoteSettings(initial_rate=0.0), fetch=jaeger)
    assert kept_share(sampler) == 0.0
    assert sampler.poll()
    assert jaeger.urls == ["http://localhost:5778/api/sampling?service=gateway"]
    assert abs(kept_share(sampler) - 0.5) < 0.02
    assert gauge("", "share") == 0.5
    jaeger.answer = per_operation(0.0, {PREDICT: 1.0})
    assert sampler.poll()
    assert kept_share(sampler, PREDICT) == 1.0
    assert kept_share(sampler, "hopline.gateway.v1.GatewayService/PredictStream") == 0.0
    assert (gauge("", "share"), gauge(PREDICT, "share")) == (0.0, 1.0)
    decided = sampler.should_sample(None, TRACE_IDS[0], PREDICT)
    assert decided.attributes == {"sampler.type": Kept.PROBABILISTIC.value, "sampler.param": 1.0}
    assert PREDICT in sampler.get_description()
    jaeger.answer = probabilistic(0.0)
    assert sampler.poll()
    assert gauge(PREDICT, "share") is None  # the operation's rule is gone, and its gauge


def test_rate_limiting_keeps_at_most_its_rate_and_refills_with_time() -> None:
    clock = FakeClock()
    limited = {"strategyType": 1, "rateLimitingSampling": {"maxTracesPerSecond": 2}}
    sampler = JaegerRemoteSampler(
        "gateway", RemoteSettings(initial_rate=0.0), fetch=FakeJaeger(limited), clock=clock
    )
    assert sampler.poll()
    assert gauge("", "max_per_second") == 2.0
    first = [kept(sampler, t) for t in TRACE_IDS[:50]]
    assert sum(first) == 2  # a full bucket of two, then nothing until time passes
    clock.now += 0.5  # one credit back
    later = [sampler.should_sample(None, t, PREDICT) for t in TRACE_IDS[50:55]]
    assert [r.decision is Decision.RECORD_AND_SAMPLE for r in later] == [True] + [False] * 4
    assert later[0].attributes == {"sampler.type": "ratelimiting", "sampler.param": 2.0}


def test_a_lower_bound_adds_traces_only_where_the_share_keeps_too_few() -> None:
    clock = FakeClock()
    floor = per_operation(0.0, {PREDICT: 0.0}, floor=1)
    sampler = JaegerRemoteSampler(
        "gateway", RemoteSettings(initial_rate=0.0), fetch=FakeJaeger(floor), clock=clock
    )
    assert sampler.poll()
    assert gauge("", "max_per_second") == 1.0  # a floor over a zero share is a ceiling too
    assert sum(kept(sampler, t) for t in TRACE_IDS[:20]) == 1
    generous = per_operation(0.5, {}, floor=1)
    sampler = JaegerRemoteSampler(
        "gateway", RemoteSettings(initial_rate=0.0), fetch=FakeJaeger(generous), clock=clock
    )
    assert sampler.poll()
    assert gauge("", "min_per_second") == 1.0
    assert abs(kept_share(sampler) - 0.5) < 0.02  # the share, plus the one credit at most
    results = [sampler.should_sample(None, t, PREDICT) for t in TRACE_IDS[:200]]
    by_floor = [r for r in results if r.attributes and r.attributes["sampler.type"] == "lowerbound"]
    assert len(by_floor) <= 1


def test_rate_limiter_holds_at_least_one_credit() -> None:
    clock = FakeClock()
    slow = RateLimiter(0.5, clock)
    assert [slow.take(), slow.take()] == [True, False]
    clock.now += 10  # the bucket holds max(1, rate): one credit, however long it waited
    assert [slow.take(), slow.take()] == [True, False]


def test_an_unreachable_or_unreadable_jaeger_keeps_the_last_strategy_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jaeger = FakeJaeger(probabilistic(0.5))
    sampler = JaegerRemoteSampler("gateway", RemoteSettings(initial_rate=0.0), fetch=jaeger)
    assert sampler.poll()
    caplog.set_level(logging.INFO, "hopline.tracing.remote_sampling")
    cut_short = http.client.IncompleteRead(b"{")  # not an OSError
    for answer in [ConnectionRefusedError("refused"), cut_short, {"strategyType": 9}, "not json"]:
        jaeger.answer = answer
        assert not sampler.poll()
        assert abs(kept_share(sampler) - 0.5) < 0.02
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "keeping the last one" in warnings[0].getMessage()
    jaeger.answer = probabilistic(0.5)
    assert sampler.poll()
    assert any("readable again" in r.getMessage() for r in caplog.records)


def _under(trace_id: int, sampled: bool, remote: bool) -> Any:
    """A context whose current span is of `trace_id`, `sampled` or not, from another process
    (`remote`) or this one."""
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    parent = SpanContext(trace_id, 0xB, is_remote=remote, trace_flags=flags)
    return set_span_in_context(NonRecordingSpan(parent))


def test_a_traces_spans_follow_its_root_and_spend_no_credit() -> None:
    """`jaeger_remote` without the prefix decided every span on its own: under rate limiting
    each spent a credit, and 67 of 73 kept traces were their root alone (a tracing probe).
    A trace is decided once, where it enters the mesh; its other spans follow."""
    clock = FakeClock()
    limited = {"strategyType": 1, "rateLimitingSampling": {"maxTracesPerSecond": 2}}
    edge = JaegerRemoteSampler(
        "gateway", RemoteSettings(initial_rate=0.0), fetch=FakeJaeger(limited), clock=clock
    )
    assert edge.poll()
    first, second, third = TRACE_IDS[:3]
    assert kept(edge, first)
    for _ in range(10):  # the root's hops and co-located servers: no credit each
        child = edge.should_sample(_under(first, True, remote=False), first, "tokenize")
        assert child.decision is Decision.RECORD_AND_SAMPLE
        assert not child.attributes  # the root says why; its children do not
        again = edge.should_sample(_under(first, True, remote=True), first, "Tokenize")
        assert again.decision is Decision.RECORD_AND_SAMPLE
    assert kept(edge, second)  # the bucket's second credit was still there
    assert not kept(edge, third)
    # A caller's decision is not taken at the edge: a sampled traceparent spends a credit.
    clock.now += 0.5
    assert edge.should_sample(_under(TRACE_IDS[3], True, remote=True), TRACE_IDS[3], PREDICT)
    assert not kept(edge, TRACE_IDS[4])

    inside = JaegerRemoteSampler(
        "inference", RemoteSettings(initial_rate=0.0), edge=False, fetch=FakeJaeger(limited)
    )
    assert inside.poll()
    for trace_id, sampled in ((first, True), (third, False)):
        result = inside.should_sample(_under(trace_id, sampled, remote=True), trace_id, "Infer")
        assert (result.decision is Decision.RECORD_AND_SAMPLE) is sampled
