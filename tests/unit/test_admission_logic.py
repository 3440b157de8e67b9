"""gateway/admission.py's decisions on their own: limits, deadline estimates, lookup budget
cuts and the overload skip (the mesh test shows them through real processes)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import grpc
import pytest
from fake_clock import FakeClock

from hopline.gateway.admission import (
    ACTIVE_S,
    MAX_SAMPLE_AGE_S,
    MIN_PROBE_EVERY,
    MIN_SAMPLES,
    WINDOW,
    Admission,
    Recent,
)
from hopline.gateway.errors import RequestError
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime.fairness import FLOW

if TYPE_CHECKING:
    from hopline.gateway.call import PredictCall


@dataclasses.dataclass
class Call:
    """What Admission reads and writes of a PredictCall."""

    timeout_s: float = 10.0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    cache: gateway_pb2.CacheInfo = dataclasses.field(default_factory=gateway_pb2.CacheInfo)
    response: gateway_pb2.PredictResponse = dataclasses.field(
        default_factory=lambda: gateway_pb2.PredictResponse(tenant="default")
    )

    spent: bool = False  # its deadline has run out

    def left_s(self) -> float:
        # A call that has just come in has its whole budget left.
        return 0.0 if self.spent else self.timeout_s


def call(timeout_s: float = 10.0, tenant: str = "default") -> PredictCall:
    return cast("PredictCall", Call(timeout_s, response=gateway_pb2.PredictResponse(tenant=tenant)))


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


def test_a_burst_that_is_over_no_longer_refuses_short_deadlines_or_cuts_lookups() -> None:
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=0, cache_budget_ms=40, clock=clock)
    run_misses(admission, ms=100, count=WINDOW)  # a burst: every path 100 ms
    with pytest.raises(RequestError), admission.admit(call(0.05)):
        pass
    assert admission.lookup_budget_s(call(0.12)) == pytest.approx(0.02)
    clock.now += MAX_SAMPLE_AGE_S + 0.001  # nothing since: no estimate, nothing refused
    assert admission.path_estimate_s(0.1) is None
    with admission.admit(call(0.05)):
        pass
    assert admission.lookup_budget_s(call(0.12)) == pytest.approx(0.04)


def test_short_deadlines_that_keep_coming_probe_the_path_and_stop_being_refused() -> None:
    """A refused request adds no sample: without probes a stream of short deadlines would be
    refused for as long as the burst's paths were the last ones seen."""
    admission = Admission(max_in_flight=0, cache_budget_ms=40, clock=FakeClock(1000.0))
    run_misses(admission, ms=100, count=WINDOW)
    outcomes: list[bool] = []
    codes: set[grpc.StatusCode] = set()
    for _ in range(200):  # the model is fast again (10 ms paths); every deadline is 50 ms
        c = call(0.05)
        try:
            with admission.admit(c):
                c.timings.update(tokenize=2.5, inference=5, postprocess=2.5)
            outcomes.append(True)
        except RequestError as err:
            codes.add(err.code)
            outcomes.append(False)
    assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert outcomes[: MIN_PROBE_EVERY - 1] == [False] * (MIN_PROBE_EVERY - 1)
    assert outcomes[MIN_PROBE_EVERY - 1]  # the probe
    # The probe's path is the newest: the gateway believes it at once and refuses nothing
    # more (waiting for the 10th percentile of 64 paths to move took 7 probes, 63 refusals).
    assert all(outcomes[MIN_PROBE_EVERY - 1 :])


def test_an_overloaded_cache_is_forgotten_once_its_overruns_are_old() -> None:
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=0, cache_budget_ms=40, clock=clock)
    for _ in range(MIN_SAMPLES):
        admission.lookup_finished(overran=True)
    assert admission.overloaded()
    clock.now += MAX_SAMPLE_AGE_S + 0.001
    assert not admission.overloaded()
    assert not admission.skip_lookup(call())


def test_recent_keeps_its_window_in_order_as_samples_come_and_expire() -> None:
    now = [0.0]
    recent = Recent(lambda: now[0])
    rng = random.Random(7)
    kept: list[tuple[float, float]] = []  # (at, value), what the window should hold
    for step in range(2_000):
        now[0] += rng.choice((0.001, 0.01, 0.5, 2.0 if step % 97 else MAX_SAMPLE_AGE_S + 1))
        value = round(rng.uniform(0.001, 0.05), rng.choice((2, 6)))  # repeats too
        recent.append(value)
        kept = [*kept, (now[0], value)][-WINDOW:]
        kept = [(at, v) for at, v in kept if at >= now[0] - MAX_SAMPLE_AGE_S]
        assert recent.count() == len(kept)
        assert recent.ordered() == sorted(v for _, v in kept)
        assert recent.total == pytest.approx(sum(v for _, v in kept), abs=1e-9)


def test_a_tenant_alone_gets_every_place() -> None:
    admission = Admission(max_in_flight=8, cache_budget_ms=40, tenant_min_in_flight=2)
    with contextlib.ExitStack() as held:
        for _ in range(8):
            held.enter_context(admission.admit(call(tenant="flood")))
        with pytest.raises(RequestError) as refused, admission.admit(call(tenant="flood")):
            pass
    assert "limit of 8 requests in flight" in refused.value.message


def test_while_others_send_a_tenant_holds_at_most_its_share() -> None:
    """One tenant's flood took every place: the other tenants' requests were refused (a
    helper's probe: 48 of 75, 106 of 130) and queued behind it. Once another tenant sends,
    the flood is held to its share, the other's requests find places, and when the other
    has been quiet for ACTIVE_S the flood may take every place again."""
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=8, cache_budget_ms=40, clock=clock, tenant_min_in_flight=2)
    with contextlib.ExitStack() as held:
        for _ in range(7):
            held.enter_context(admission.admit(call(tenant="flood")))
        held.enter_context(admission.admit(call(tenant="quiet")))
        with pytest.raises(RequestError) as refused, admission.admit(call(tenant="quiet")):
            pass  # the gateway is full: refused, but now the quiet tenant counts as sending
        assert "limit of 8" in refused.value.message
    with contextlib.ExitStack() as held:
        for _ in range(4):  # 8 places / 2 tenants
            held.enter_context(admission.admit(call(tenant="flood")))
        with pytest.raises(RequestError) as refused, admission.admit(call(tenant="flood")):
            pass
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.message.startswith(
            "this tenant has 4 texts in flight, its share of the gateway's places now"
        )
        assert "tenants" not in refused.value.message.split("(")[0]  # not how many send
        for _ in range(4):
            held.enter_context(admission.admit(call(tenant="quiet")))
    clock.advance(3600)  # the quiet tenant stopped sending: no share now, but the gateway
    with contextlib.ExitStack() as held:  # is shared, so places are kept for its next request
        for _ in range(6):
            held.enter_context(admission.admit(call(tenant="flood")))
        with pytest.raises(RequestError) as refused, admission.admit(call(tenant="flood")):
            pass
        # The same words: that places are kept for other tenants says that they exist.
        assert "6 texts in flight, its share of the gateway's places now" in (refused.value.message)
        assert "other tenants" not in refused.value.message
        with admission.admit(call(tenant="quiet")):  # an hour later, still a place
            pass


def test_a_share_is_at_least_the_tenant_minimum_and_names_are_not_kept() -> None:
    """Many tenants each get the minimum (the gateway's own limit still binds), and tenant
    names are forgotten once quiet: 10,000 names leave nothing behind."""
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=8, cache_budget_ms=40, clock=clock, tenant_min_in_flight=2)
    for n in range(10_000):
        with admission.admit(call(tenant=f"t{n}")):
            pass
    with (
        admission.admit(call(tenant="a")),
        admission.admit(call(tenant="a")),
        pytest.raises(RequestError),
        admission.admit(call(tenant="a")),
    ):
        pass  # 8 // 10,001 tenants is 0: the minimum, 2
    clock.advance(ACTIVE_S + 0.1)
    admission.tenants.sending()
    assert admission.tenants.in_flight == {}
    assert admission.tenants.sending() == 0


def test_a_tenant_sending_less_than_once_a_second_still_finds_a_place() -> None:
    """A flood held every place, and a tenant sending every 2 s was refused 16 of 20 times
    by the gateway's limit (each of its requests was the first in ACTIVE_S, so no share
    applied; a helper's probe over PredictStream), one sending once a minute every time.
    Once a gateway is shared the flood leaves the minimum free."""
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=8, cache_budget_ms=40, clock=clock, tenant_min_in_flight=2)
    with admission.admit(call(tenant="slow")):
        pass
    served = 0
    with contextlib.ExitStack() as held:
        for gap_s in (2.0, 2.0, 61.0, 3600.0, 2.0, 61.0, 2.0, 2.0, 600.0, 2.0):
            clock.advance(gap_s)
            while True:  # the flood takes every place it may
                try:
                    held.enter_context(admission.admit(call(tenant="flood")))
                except RequestError:
                    break
            with admission.admit(call(tenant="slow")):
                served += 1
    assert served == 10


@contextlib.contextmanager
def held_apart(held: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """`held` entered and left in a context of its own, as each batch is served in its own
    task: its `HELD` mark does not reach the requests admitted beside it."""
    context = contextvars.copy_context()
    context.run(held.__enter__)
    try:
        yield
    finally:
        context.run(held.__exit__, None, None, None)


def test_a_light_tenant_finds_a_place_beside_more_flooding_tenants_than_minimums_fit() -> None:
    """Eight tenants sending 64-text batches (32 places each, the minimum) held all 256
    places, and a light tenant's requests were refused at the gateway's limit (a load
    probe: 303 of 727): the minimums added up past the limit. Past its equal part, a
    tenant's minimum now admits only while an equal part stays free for a tenant within its
    own; with a minimum of half the limit a batch still finds room on a busy gateway."""
    clock = FakeClock(1000.0)
    admission = Admission(
        max_in_flight=256, cache_budget_ms=40, clock=clock, tenant_min_in_flight=32
    )
    with admission.admit(call(tenant="light")):
        pass
    admitted = 0
    with contextlib.ExitStack() as held:
        for n in range(8):
            with contextlib.suppress(RequestError):
                held.enter_context(held_apart(admission.hold(f"bulk{n}", 32, 10.0)))
                admitted += 1
        # The eighth is past its equal part (256 / 9 tenants) by its minimum, and would take
        # the last equal part; the seven before it were within theirs when they came.
        assert admitted == 7
        assert admission.in_flight == 224
        with pytest.raises(RequestError) as refused, admission.admit(call(tenant="bulk0")):
            pass
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this tenant has 32 texts in flight" in refused.value.message
        for _ in range(28):  # the light tenant's equal part
            held.enter_context(admission.admit(call(tenant="light")))
        assert admission.in_flight == 252
    assert admission.in_flight == 0
    # A minimum of half the limit, three tenants sending: a batch of the minimum's width
    # from a tenant holding nothing is admitted beside two places taken.
    small = Admission(max_in_flight=8, cache_budget_ms=40, clock=clock, tenant_min_in_flight=4)
    with small.admit(call(tenant="a")), small.admit(call(tenant="b")), small.hold("c", 4, 10.0):
        assert small.in_flight == 6


@pytest.mark.parametrize(("minimum", "refused"), [(0, False), (1, True)])
def test_no_tenant_share_when_it_is_off(minimum: int, refused: bool) -> None:
    admission = Admission(max_in_flight=4, cache_budget_ms=40, tenant_min_in_flight=minimum)
    with admission.admit(call(tenant="a")), contextlib.ExitStack() as held:
        for _ in range(2):  # 4 places / 2 tenants
            held.enter_context(admission.admit(call(tenant="b")))
        third = contextlib.nullcontext() if not refused else pytest.raises(RequestError)
        with third, admission.admit(call(tenant="b")):
            pass


def test_an_admitted_request_runs_as_its_tenants_flow() -> None:
    """The stage queues and the model's batcher share their turns by FLOW (runtime/
    fairness.py): set to the tenant while the request holds its place, unset after (a
    local-tier answer is not admitted at all: tests/unit/test_gateway_own_steps.py)."""
    admission = Admission(max_in_flight=8, cache_budget_ms=40)
    assert FLOW.get() is None
    with admission.admit(call(tenant="tenant-a")):
        assert FLOW.get() == "tenant-a"
        with admission.admit(call(tenant="tenant-b")):
            assert FLOW.get() == "tenant-b"
        assert FLOW.get() == "tenant-a"
    assert FLOW.get() is None


@pytest.mark.parametrize(("limit", "minimum"), [(256, 32), (64, 32), (8, 2), (3, 32), (1, 1)])
def test_a_batch_of_batch_width_texts_is_never_refused_by_its_own_share(
    limit: int, minimum: int
) -> None:
    """A ModelInfer batch's texts go in flight batch_width(tenant) at a time: that many of one
    tenant are admitted whatever the other tenants do (a 64-text batch beside five tenants
    was refused at every try, by its own texts)."""
    clock = FakeClock(1000.0)
    admission = Admission(
        max_in_flight=limit, cache_budget_ms=40, clock=clock, tenant_min_in_flight=minimum
    )
    with admission.admit(call(tenant="bulk")):
        pass
    # A gateway one tenant has had to itself refuses it no share: its batches run whole; a
    # second tenant's first batch already waits its turns (its own first text shares it).
    assert admission.batch_width("bulk") is None
    assert admission.batch_width("another") is not None
    for n in range(10_000):  # every other tenant sending: shares at their smallest
        with admission.admit(call(tenant=f"t{n}")):
            pass
    width = admission.batch_width("bulk")
    assert width is not None
    with contextlib.ExitStack() as held:
        for _ in range(width):
            held.enter_context(admission.admit(call(tenant="bulk")))
    with admission.hold("bulk", width, 10.0):  # or held whole, as a batch is
        pass
    no_shares = Admission(max_in_flight=0, cache_budget_ms=40, tenant_min_in_flight=32)
    assert no_shares.batch_width("bulk") is None
    assert Admission(max_in_flight=64, cache_budget_ms=40).batch_width("bulk") is None


def test_a_batch_is_admitted_or_refused_whole_and_its_texts_take_no_places_of_their_own() -> None:
    """Admitted text by text, a batch was refused halfway, its first texts' work thrown away
    (an overload probe: 8 callers of 64-text batches, 1,023 of 1,091 refused after 13,132
    texts were tokenized for 4,352 answered). `hold` takes the batch's places before any
    text runs; each text's `admit` within it takes none."""
    admission = Admission(max_in_flight=8, cache_budget_ms=40)
    with admission.hold("bulk", 5, 10.0):
        assert admission.in_flight == 5
        with admission.admit(call(tenant="bulk")), admission.admit(call(tenant="bulk")):
            assert admission.in_flight == 5  # the batch's texts run in its places
        with pytest.raises(RequestError) as refused, admission.hold("other", 4, 10.0):
            pass  # 3 places left: the second batch is refused whole, before any work
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with admission.hold("other", 3, 10.0):
            assert admission.in_flight == 8
    assert admission.in_flight == 0


class _RanOut(Exception):
    """A request's deadline ran out while it was worked on."""


def test_deadlines_that_keep_running_out_are_refused_once_no_path_completes() -> None:
    """Paths are forgotten after MAX_SAMPLE_AGE_S, and deadlines too short for any answer
    complete none: the gate opened and every such request ran the model for a caller gone (a
    client probe: 6 ms deadlines on a 14 ms path, 23 to 80 model runs a burst, no answer).
    What those requests had left when they ran out is the evidence; a completed path (a
    probe's) ends it."""
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=0, cache_budget_ms=40, clock=clock)
    run_misses(admission, ms=14)
    clock.now += MAX_SAMPLE_AGE_S + 0.001  # the warm-up's paths are forgotten

    def short(on_admit: Callable[[Call], None]) -> bool:
        """A 6 ms request, at a hundred a second; whether it was admitted."""
        clock.advance(0.011)
        c = Call(timeout_s=0.006)
        try:
            with admission.admit(cast("PredictCall", c)):
                on_admit(c)
        except RequestError:
            return False
        except _RanOut:
            pass
        return True

    def runs_out(c: Call) -> None:
        c.spent = True
        raise _RanOut

    admitted = [short(runs_out) for _ in range(50)]
    assert admitted[:MIN_SAMPLES] == [True] * MIN_SAMPLES
    assert sum(admitted[MIN_SAMPLES:]) == (50 - MIN_SAMPLES) // MIN_PROBE_EVERY  # probes only
    with pytest.raises(RequestError) as refused, admission.admit(call(0.006)):
        pass
    assert "no recent request with up to 6 ms left" in refused.value.message
    with admission.admit(call(0.5)):  # a longer deadline is let in
        pass

    def answered(c: Call) -> None:  # the model is fast again
        c.timings.update(tokenize=1, inference=2, postprocess=1)

    while not short(answered):  # refused until the next probe, which completes
        pass
    assert all(short(answered) for _ in range(20))


def test_a_batch_that_runs_out_counts_once_and_a_capped_request_not_at_all() -> None:
    """Counted per text, one 16-text batch that ran out armed the gate alone (its texts
    cancelled together past their shared deadline), and 9 of the next 10 single requests
    were refused; and requests with no deadline of their own (the gateway's cap) that ran out
    in a stall refused every capped request after it, told to give a longer deadline they
    cannot give (a reviewer's snippets)."""
    admission = Admission(max_in_flight=0, cache_budget_ms=40, cap_s=10.0)

    def batch_runs_out() -> None:
        with contextlib.suppress(_RanOut), admission.hold("bulk", 16, 0.001):
            time.sleep(0.002)  # the batch's deadline passes
            for _ in range(16):
                c = Call(timeout_s=0.001)
                with contextlib.suppress(_RanOut), admission.admit(cast("PredictCall", c)):
                    c.spent = True
                    raise _RanOut
            raise _RanOut

    for _ in range(MIN_SAMPLES - 1):
        batch_runs_out()
    with admission.admit(call(0.001)):  # 7 batches: 7 samples, the gate not armed
        pass

    capped = Admission(max_in_flight=0, cache_budget_ms=40, cap_s=10.0)
    for _ in range(3 * MIN_SAMPLES):
        c = Call(timeout_s=10.0)
        with contextlib.suppress(_RanOut), capped.admit(cast("PredictCall", c)):
            c.spent = True
            raise _RanOut
    with capped.admit(call(10.0)), capped.admit(call(0.5)):
        pass


def test_hopeless_deadlines_sent_fast_are_probed_at_most_ten_times_a_second() -> None:
    """By count alone one in ten went through: 2,243 model runs for 21,906 requests of 3 ms,
    none answered in time (a load probe)."""
    clock = FakeClock(1000.0)
    admission = Admission(max_in_flight=0, cache_budget_ms=40, clock=clock)
    run_misses(admission, ms=14)  # a path takes 14 ms
    probes = 0
    for _ in range(1000):  # a second of 3 ms deadlines at 1,000 a second
        clock.advance(0.001)
        with contextlib.suppress(RequestError), admission.admit(call(0.003)):
            probes += 1
    assert 9 <= probes <= 11
