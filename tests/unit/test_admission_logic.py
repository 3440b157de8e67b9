"""gateway/admission.py's decisions on their own: limits, deadline estimates, lookup budget
cuts and the overload skip (the mesh test shows them through real processes)."""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, cast

import grpc
import pytest

from hopline.gateway.admission import MIN_SAMPLES, Admission
from hopline.gateway.errors import RequestError
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2

if TYPE_CHECKING:
    from hopline.gateway.call import PredictCall


@dataclasses.dataclass
class Call:
    """What Admission reads and writes of a PredictCall."""

    timeout_s: float = 10.0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    cache: gateway_pb2.CacheInfo = dataclasses.field(default_factory=gateway_pb2.CacheInfo)


def call(timeout_s: float = 10.0) -> PredictCall:
    return cast("PredictCall", Call(timeout_s))


def run_misses(admission: Admission, ms: float, count: int = MIN_SAMPLES) -> None:
    for _ in range(count):
        c = call()
        with admission.admit(c):
            c.timings.update(tokenize=ms / 4, inference=ms / 2, postprocess=ms / 4)


def test_the_in_flight_limit_refuses_the_next_request_and_frees_its_place() -> None:
    admission = Admission(max_in_flight=2, cache_budget_ms=40)
    with admission.admit(call()), admission.admit(call()):
        with pytest.raises(RequestError) as refused, admission.admit(call()):
            pass
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with admission.admit(call(), free=True):  # a local-tier answer is never refused
            pass
    assert admission.in_flight == 0
    with admission.admit(call()):
        assert admission.in_flight == 1


def test_no_deadline_refusal_until_the_gateway_has_seen_model_answers() -> None:
    admission = Admission(max_in_flight=0, cache_budget_ms=40)
    with admission.admit(call(0.001)):
        pass
    run_misses(admission, ms=100)
    with pytest.raises(RequestError) as refused, admission.admit(call(0.05)):
        pass
    assert refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with admission.admit(call(0.5)):
        pass


def test_the_lookup_budget_is_cut_to_what_the_deadline_leaves_after_a_typical_miss() -> None:
    admission = Admission(max_in_flight=0, cache_budget_ms=40)
    assert admission.lookup_budget_s(call(0.1)) == pytest.approx(0.04)  # no estimate yet
    run_misses(admission, ms=100)
    assert admission.lookup_budget_s(call(10)) == pytest.approx(0.04)
    assert admission.lookup_budget_s(call(0.12)) == pytest.approx(0.02)
    short = call(0.1005)
    assert admission.skip_lookup(short)
    assert short.cache.outcome == common_pb2.CACHE_OUTCOME_SKIPPED
    assert "deadline" in short.cache.detail


def test_an_overloaded_cache_is_skipped_but_still_probed_and_its_recovery_seen() -> None:
    admission = Admission(max_in_flight=0, cache_budget_ms=40, rng=random.Random(7))
    for _ in range(MIN_SAMPLES):
        assert not admission.skip_lookup(call())
        admission.lookup_finished(overran=True)
    decisions = [admission.skip_lookup(call()) for _ in range(1000)]
    assert 850 < sum(decisions) < 950  # one lookup in ten still goes
    for _ in range(64):
        admission.lookup_finished(overran=False)
    assert not any(admission.skip_lookup(call()) for _ in range(100))


def test_nothing_adapts_when_adaptation_is_off() -> None:
    admission = Admission(max_in_flight=0, cache_budget_ms=40, adaptive_cache=False)
    run_misses(admission, ms=100)
    for _ in range(MIN_SAMPLES):
        admission.lookup_finished(overran=True)
    assert not admission.skip_lookup(call(0.1))
    assert admission.lookup_budget_s(call(0.1)) == pytest.approx(0.04)
