"""Admission control: the gateway refuses at once what it cannot serve, instead of queueing.

- **In flight**: past `max_in_flight` requests being worked on, a new one gets
  RESOURCE_EXHAUSTED at once; queued behind the others it would only time out, and add to
  the backlog that makes the others time out too. Repeats answered by the local exact tier
  cost no hop and are never refused.
- **A tenant's share**: while several tenants send (a request arrived or ended within
  `ACTIVE_S`), each may hold `max_in_flight` / tenants requests in flight, at least
  `tenant_min_in_flight`; past it, its new ones get RESOURCE_EXHAUSTED. Without it one
  tenant's flood took every place: a helper's probe, 300 callers of one tenant, made the other
  tenants' requests fail RESOURCE_EXHAUSTED (48 of 75, 106 of 130) and wait 1.0-1.8 s at the
  median behind the flood's queue (18-35 ms alone). A gateway that has only ever served one
  tenant lets it take every place; once a second tenant has sent, no tenant holds the last
  minimum, so any other's next request finds one; and while more tenants send than the
  limit holds minimums, a tenant past its equal part leaves an equal part free for those
  within theirs. An admitted request runs as its tenant's
  flow (`runtime/fairness.py:FLOW`): the stage queues and the model's batcher serve the
  tenants waiting there in equal shares.
- **Deadline**: when the deadline left is shorter than the fastest recent inference path
  (tokenize, inference, postprocess: the 10th percentile of the last `WINDOW` misses), the
  request gets DEADLINE_EXCEEDED at once rather than running a model whose answer could not
  arrive in time. "Recent" is also at most `MAX_SAMPLE_AGE_S` old, and one refusal in
  `MIN_PROBE_EVERY`, at most one each `PROBE_MIN_S`, is let through as a probe: a refused
  request adds no sample, so without both, the paths of a burst that is over would refuse
  every short deadline from then on.
  A probe that comes back faster is believed at once (the estimate is never above the
  newest path). While no path has completed within `MAX_SAMPLE_AGE_S` but `MIN_SAMPLES`
  admitted requests ran out of deadline (a batch once; not those whose only deadline was the
  gateway's cap), a deadline no longer than most of theirs (`EXPIRED_QUANTILE`) is refused
  the same way: when nothing completes, the paths alone said nothing, and every
  short deadline ran the model for a caller already gone.
- **The cache lookup**: its budget is HOPLINE_CACHE_BUDGET_MS cut to what the deadline
  leaves after a typical (median) inference path, so a lookup never eats the time a miss
  needs; a lookup left with less than `MIN_LOOKUP_MS` is skipped (reason `deadline`). When
  more than half of the last `WINDOW` lookups overran their budget, the cache cannot keep
  up: only the share of lookups that made it in time go to it (at least one in
  `MIN_PROBE_EVERY`, so it is still probed and its recovery seen), and the others skip it
  (reason `overloaded`) instead of each waiting out the budget for nothing. These windows
  forget what is older than `MAX_SAMPLE_AGE_S` too.

A skipped lookup is a SKIPPED outcome whose detail says why, with the reason in the
`hopline.cache.skip_reason` span attribute and `hopline_cache_lookups_skipped_total{reason}`;
refusals are counted in `hopline_gateway_refused_total{reason}` and named in
`hopline.admission.refused` on the request's span.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import contextvars
import enum
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from hopline.gateway.errors import RequestError
from hopline.observability import metrics, schema
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.fairness import FLOW

if TYPE_CHECKING:
    from hopline.gateway.call import PredictCall

WINDOW = 64  # recent inference paths and lookups the estimates are taken over
MIN_SAMPLES = 8  # no estimate (so no refusal, no cut) before this many
MIN_LOOKUP_MS = 2.0  # a lookup with less time than this cannot answer: skip it
OVERLOADED_SHARE = 0.5  # share of recent lookups over budget that marks the cache overloaded
MIN_PROBE_EVERY = 10  # while overloaded, at least one lookup (or refusal) in this many goes
PROBE_MIN_S = 0.1  # and a deadline refusal's probe at most this often (Admission._refuse_deadline)
MAX_SAMPLE_AGE_S = 10.0  # a path or lookup older than this says nothing about now
# The share of recently run-out deadlines a refused one is no longer than (Admission.
# _check_deadline): most of them, not the longest.
EXPIRED_QUANTILE = 0.9
INFERENCE_HOPS = ("tokenize", "inference", "postprocess")  # schema.SPAN_* of the miss path


# Set while a batch's texts run in the places `Admission.hold` took for them: each text's
# `admit` takes none of its own (the batch was refused or admitted whole).
HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("hopline_held", default=False)


class Refusal(enum.StrEnum):
    IN_FLIGHT = "in_flight"
    TENANT_SHARE = "tenant_share"
    DEADLINE = "deadline"
    STREAMS = "streams"  # a stream past HOPLINE_GATEWAY_MAX_STREAMS or its tenant's half


ACTIVE_S = 1.0  # a tenant counts as sending this long after a request of its arrived or ended


class Tenancy:
    """Whether more than one tenant has ever used the gateway: from then on places are kept
    for the tenants other than a flood's (requests in flight, open streams)."""

    def __init__(self) -> None:
        self._first: str | None = None
        self.shared = False

    def seen(self, tenant: str) -> None:
        if self._first is None:
            self._first = tenant
        elif tenant != self._first:
            self.shared = True

    def shared_with(self, tenant: str) -> bool:
        """Whether another tenant than `tenant` has come (`shared` once `tenant` does)."""
        return self.shared or (self._first is not None and tenant != self._first)


class TenantShares:
    """Which tenants are sending now, and each one's requests in flight. Memory follows the
    tenants of the last ACTIVE_S and those in flight, never every tenant name seen; and
    whether more than one tenant has ever sent (`tenancy`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        # A tenant that sends less than once per ACTIVE_S found every place held by a flood,
        # each of its requests the first (a probe: 16 of 20 refused at one every 2 s; one a
        # minute, every one): once the gateway is shared, places are kept for such a tenant.
        self.tenancy = Tenancy()
        self.in_flight: dict[str, int] = {}

    def seen(self, tenant: str) -> None:
        now = self._clock()
        self._seen[tenant] = now
        self._seen.move_to_end(tenant)
        self.tenancy.seen(tenant)

    def sending(self) -> int:
        """Tenants that sent within ACTIVE_S or have requests in flight."""
        oldest = self._clock() - ACTIVE_S
        while self._seen and next(iter(self._seen.values())) < oldest:
            self._seen.popitem(last=False)
        return len(self._seen) + sum(1 for t in self.in_flight if t not in self._seen)

    def enter(self, tenant: str, places: int = 1) -> None:
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + places

    def leave(self, tenant: str, places: int = 1) -> None:
        left = self.in_flight[tenant] - places
        if left:
            self.in_flight[tenant] = left
        else:
            del self.in_flight[tenant]
        self.seen(tenant)


class SkipReason(enum.StrEnum):
    DEADLINE = "deadline"
    OVERLOADED = "overloaded"


class Recent:
    """The last `WINDOW` samples, less those older than `MAX_SAMPLE_AGE_S`, their sum, and
    their values in order (kept as samples come and go: sorting the window again for each
    request after each new sample cost about 5 us of the event loop a miss)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)
        self._ordered: list[float] = []
        self.total = 0.0

    def append(self, value: float) -> None:
        if len(self._samples) == WINDOW:
            self._forget(self._samples[0][1])
        self._samples.append((self._clock(), value))
        bisect.insort(self._ordered, value)
        self.total += value

    def count(self) -> int:
        """How many samples are recent, once the older ones are forgotten."""
        samples, oldest = self._samples, self._clock() - MAX_SAMPLE_AGE_S
        while samples and samples[0][0] < oldest:
            self._forget(samples.popleft()[1])
        if not samples:  # no rounding left over
            self.total = 0.0
        return len(samples)

    def newest(self) -> float:
        """The latest sample's value (call `count` first: it must be there)."""
        return self._samples[-1][1]

    def ordered(self) -> list[float]:
        """The values, least first (the list itself: read, do not change it)."""
        return self._ordered

    def _forget(self, value: float) -> None:
        self.total -= value
        del self._ordered[bisect.bisect_left(self._ordered, value)]


class Admission:
    """The gateway's admission decisions; one per gateway, on its event loop (no locks)."""

    def __init__(
        self,
        max_in_flight: int,
        cache_budget_ms: float,
        adaptive_cache: bool = True,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenant_min_in_flight: int = 0,
        cap_s: float = math.inf,
    ) -> None:
        self.max_in_flight = max_in_flight  # 0: no limit
        # The gateway's own cap on a request (HOPLINE_UPSTREAM_TIMEOUT_S): a request with no
        # deadline of the caller's has it, and cannot be given a longer one, so its running
        # out (a stall) is no evidence that deadlines are too short.
        self.cap_s = cap_s
        self.tenant_min_in_flight = tenant_min_in_flight  # 0: no tenant's share
        self.tenants = TenantShares(clock)
        self.cache_budget_s = cache_budget_ms / 1e3
        self.adaptive_cache = adaptive_cache
        self.in_flight = 0
        self._paths_s = Recent(clock)
        # What admitted requests had left when their deadline ran out before the answer:
        # while no path completes, the only evidence of how long one takes.
        self._expired_s = Recent(clock)
        self._deadline_refusals = 0  # since the last probe (`_refuse_deadline`)
        self._clock = clock
        self._probed_at = -math.inf  # the clock's: when the last probe went through
        self._overruns = Recent(clock)
        self._rng = rng or random.Random()

    # -- requests ---------------------------------------------------------------------------

    def batch_width(self, tenant: str) -> int | None:
        """How many texts of one request (a ModelInfer batch) go in flight at once, the rest
        following as they finish: no more than the places a tenant is always left, so a
        batch within the advertised `max_texts_per_request` is never refused by its own
        texts' share (a batch of 64 beside five tenants sending once a second was refused
        RESOURCE_EXHAUSTED at every try, "this tenant has 42 requests in flight"). None
        without tenants' shares, or while `tenant` has the gateway to itself: a gateway one
        tenant has had to itself refuses it no share."""
        if self._shares() is None or not self.tenants.tenancy.shared_with(tenant):
            return None
        return max(1, self._kept())

    def stream_width(self, tenant: str) -> int | None:
        """How many texts one stream holds in flight at once: `batch_width`, and at most half
        the gateway's places. One stream is one caller: with the whole limit its backlog
        (80 requests of 64 texts) held all 256 places, and every other request of its tenant
        was refused RESOURCE_EXHAUSTED while it ran (a client probe: 63 of 66)."""
        width = self.batch_width(tenant)
        if not self.max_in_flight:
            return width
        half = max(1, self.max_in_flight // 2)
        return half if width is None else min(width, half)

    def path_estimate_s(self, q: float) -> float | None:
        """The q-quantile of recent inference paths, or the newest path where it is faster;
        None before there are enough. The newest: after a burst the window is the burst's
        queued paths, and a probe that came back fast says the path is fast now (waiting
        for the quantile to move took 7 probes, 63 short deadlines refused, after each
        burst). Only ever more permissive: a request let in that cannot make it times out."""
        if self._paths_s.count() < MIN_SAMPLES:
            return None
        ordered = self._paths_s.ordered()
        return min(ordered[min(len(ordered) - 1, int(q * len(ordered)))], self._paths_s.newest())

    def _refuse(self, reason: Refusal, code: grpc.StatusCode, message: str) -> RequestError:
        metrics.GATEWAY_REFUSED.labels(reason.value).inc()
        trace.get_current_span().set_attribute(schema.ADMISSION_REFUSED, reason.value)
        return RequestError(code, message)

    @contextlib.contextmanager
    def admit(self, call: PredictCall) -> Iterator[None]:
        """Holds a place in flight while `call` runs; raises RequestError when it cannot. A
        local-tier repeat is not admitted: its answer is already here, so nothing is refused
        (gateway/service.py:predict_text). A text of a batch that `hold` admitted runs in
        one of the batch's places, refused nothing."""
        tenant = call.response.tenant
        held = HELD.get()
        left_s = call.left_s()
        if not held:
            self._take(tenant, 1, left_s)
        flow = FLOW.set(tenant)  # the stage queues' and batchers' fair shares
        try:
            yield
        except BaseException:
            # A batch's texts share its deadline: `hold` counts the batch once.
            if not held and call.left_s() <= 0:
                self._ran_out(left_s, call.timeout_s)
            raise
        finally:
            FLOW.reset(flow)
            if not held:
                self._give_back(tenant, 1)
        # Only a completed inference path is a sample (a coalesced wait is not one).
        if all(hop in call.timings for hop in INFERENCE_HOPS) and not call.cache.coalesced:
            self._paths_s.append(sum(call.timings[h] for h in INFERENCE_HOPS) / 1e3)

    @contextlib.contextmanager
    def hold(self, tenant: str, places: int, left_s: float) -> Iterator[None]:
        """Admits a batch of texts whole: `places` of them in flight at once, the rest taking
        turns in those places (`batch_width`); raises RequestError, before any text is worked
        on, when the places are not there. Admitted text by text, a batch was refused
        halfway, its first texts' work thrown away (an overload probe: 8 callers of 64-text
        batches, 1,023 of 1,091 refused, 13,132 texts tokenized for 4,352 answered)."""
        self._take(tenant, places, left_s)
        token = HELD.set(True)
        deadline = time.perf_counter() + left_s  # as PredictCall keeps it
        try:
            yield
        except BaseException:
            if time.perf_counter() >= deadline:
                self._ran_out(left_s, left_s)
            raise
        finally:
            HELD.reset(token)
            self._give_back(tenant, places)

    def _ran_out(self, left_s: float, budget_s: float) -> None:
        """An admitted request whose deadline ran out before its answer, with `left_s` left
        at admission; one with the gateway's cap for its budget is no evidence (a stall)."""
        if budget_s < self.cap_s:
            self._expired_s.append(left_s)

    def _take(self, tenant: str, places: int, left_s: float) -> None:
        """`places` in flight for `tenant`, or RequestError: the gateway's limit, the
        tenant's share, then the deadline."""
        shares = self._shares()
        if shares is not None:
            shares.seen(tenant)
        if self.max_in_flight and self.in_flight + places > self.max_in_flight:
            raise self._refuse(
                Refusal.IN_FLIGHT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway is at its limit of {self.max_in_flight} requests in flight "
                "(HOPLINE_GATEWAY_MAX_IN_FLIGHT): retry after a backoff",
            )
        if shares is not None:
            self._check_share(shares, tenant, places)
        self._check_deadline(left_s)
        self.in_flight += places
        metrics.GATEWAY_IN_FLIGHT.set(self.in_flight)
        if shares is not None:
            shares.enter(tenant, places)

    def _give_back(self, tenant: str, places: int) -> None:
        self.in_flight -= places
        metrics.GATEWAY_IN_FLIGHT.set(self.in_flight)
        shares = self._shares()
        if shares is not None:
            shares.leave(tenant, places)

    def _kept(self) -> int:
        """The places no tenant may take from the others on a shared gateway: the minimum,
        half the limit at most."""
        return min(self.tenant_min_in_flight, self.max_in_flight // 2)

    def _shares(self) -> TenantShares | None:
        """The tenants' shares, or None where they are off (no limit, or no minimum)."""
        return self.tenants if self.max_in_flight and self.tenant_min_in_flight else None

    def _check_deadline(self, left_s: float) -> None:
        """RequestError DEADLINE_EXCEEDED when `left_s` is too short for a model answer: less
        than the fastest recent paths, or, while no path has completed recently, no more
        than recent requests had when they ran out (until a path completes again: a probe's
        does, as below). Paths alone forgot a slow model once
        nothing completed for MAX_SAMPLE_AGE_S, and every short deadline was admitted to run
        the model for a caller already gone (a client probe: 6 ms deadlines on a 14 ms path,
        up to 80 model runs a burst of 80 for no answer)."""
        fastest = self.path_estimate_s(0.1)
        if fastest is not None:
            refused = left_s < fastest
            said = f"a model answer takes at least {fastest * 1e3:.0f} ms now"
        elif not self._paths_s.count() and self._expired_s.count() >= MIN_SAMPLES:
            # Not the longest: one caller's long deadline, cut by a stall, would refuse all.
            ran_out = self._expired_s.ordered()
            most = ran_out[int(EXPIRED_QUANTILE * (len(ran_out) - 1))]
            refused = left_s <= most
            said = f"no recent request with up to {most * 1e3:.0f} ms left got its answer in time"
        else:
            return
        if refused and self._refuse_deadline():
            left = f"leaves {left_s * 1e3:.0f} ms" if left_s > 0 else "had passed on arrival"
            raise self._refuse(
                Refusal.DEADLINE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the deadline {left}; {said}: give the request a longer deadline",
            )

    def _check_share(self, shares: TenantShares, tenant: str, places: int) -> None:
        """RequestError when `places` more would take `tenant` past its share of the places
        while others send, or into the places kept for the other tenants of a shared
        gateway."""
        held = shares.in_flight.get(tenant, 0)
        kept = self._kept()
        if held + places > self.max_in_flight - kept and shares.tenancy.shared:
            raise self._share_refused(held)
        sending = shares.sending()
        if sending < 2:
            return
        fair = self.max_in_flight // sending
        if held + places > max(fair, self.tenant_min_in_flight):
            raise self._share_refused(held)
        # Past its equal part a tenant's minimum admits only while an equal part stays free
        # for a tenant within its own: with more tenants sending than the limit over the
        # minimum, the minimums add up past the limit (a load probe: 8 tenants of 64-text
        # batches held all 256 places, and a light tenant's requests were refused at the
        # gateway's limit, 303 of 727). An equal part, not the minimum: with a minimum of half
        # the limit, keeping a minimum free admitted a batch only to an empty gateway.
        equal = max(fair, 1)
        if held + places > equal and self.in_flight + places > self.max_in_flight - equal:
            raise self._share_refused(held)

    def _share_refused(self, held: int) -> RequestError:
        # The caller's own count only: how many tenants send, or that others exist at all,
        # is theirs (a security probe read both from these messages).
        return self._refuse(
            Refusal.TENANT_SHARE,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this tenant has {held} texts in flight, its share of the gateway's places "
            "now (HOPLINE_GATEWAY_MAX_IN_FLIGHT, HOPLINE_GATEWAY_TENANT_MIN_IN_FLIGHT): retry "
            "after a backoff",
        )

    def _refuse_deadline(self) -> bool:
        """False for every MIN_PROBE_EVERY-th would-be refusal, at most one each PROBE_MIN_S:
        that request goes through, so a path that has become faster is measured even when
        every deadline is short. By count alone, hopeless deadlines sent fast ran the model
        for one in ten (a load probe: 2,243 runs for 21,906 requests of 3 ms, none in time)."""
        self._deadline_refusals += 1
        now = self._clock()
        if self._deadline_refusals >= MIN_PROBE_EVERY and now - self._probed_at >= PROBE_MIN_S:
            self._deadline_refusals, self._probed_at = 0, now
            trace.get_current_span().set_attribute(schema.ADMISSION_PROBE, True)
            return False
        return True

    # -- the cache lookup -------------------------------------------------------------------

    def lookup_budget_s(self, call: PredictCall) -> float:
        """HOPLINE_CACHE_BUDGET_MS, cut to what the deadline leaves after a typical miss."""
        typical = self.path_estimate_s(0.5) if self.adaptive_cache else None
        if typical is None:
            return self.cache_budget_s
        return max(0.0, min(self.cache_budget_s, call.left_s() - typical))

    def _overrun_share(self) -> float | None:
        """The share of recent lookups that overran their budget; None before enough."""
        count = self._overruns.count()
        return self._overruns.total / count if count >= MIN_SAMPLES else None

    def overloaded(self) -> bool:
        share = self._overrun_share()
        return share is not None and share > OVERLOADED_SHARE

    def skip_lookup(self, call: PredictCall) -> bool:
        """Whether to skip the cache for `call`; if so, its reply and span say why."""
        if not self.adaptive_cache:
            return False
        budget_ms = self.lookup_budget_s(call) * 1e3
        if budget_ms < MIN_LOOKUP_MS:
            return self._skip(
                call,
                SkipReason.DEADLINE,
                f"cache lookup skipped: the deadline leaves {budget_ms:.1f} ms for it "
                "after a typical model answer",
            )
        share = self._overrun_share()
        if share is not None and share > OVERLOADED_SHARE:
            made_it = 1.0 - share
            if self._rng.random() >= max(made_it, 1.0 / MIN_PROBE_EVERY):
                return self._skip(
                    call,
                    SkipReason.OVERLOADED,
                    f"cache lookup skipped: {1 - made_it:.0%} of recent lookups overran "
                    f"the {self.cache_budget_s * 1e3:.0f} ms budget (HOPLINE_CACHE_BUDGET_MS)",
                )
        return False

    def _skip(self, call: PredictCall, reason: SkipReason, detail: str) -> bool:
        call.cache.outcome = common_pb2.CACHE_OUTCOME_SKIPPED
        call.cache.detail = detail
        metrics.CACHE_LOOKUPS_SKIPPED.labels(reason.value).inc()
        trace.get_current_span().set_attribute(schema.CACHE_SKIP_REASON, reason.value)
        return True

    def lookup_finished(self, overran: bool) -> None:
        """A lookup's result: `overran` when it ran out of its budget."""
        self._overruns.append(1.0 if overran else 0.0)
