"""What keeps the cache from making the mesh slower or less available.

CircuitBreaker: after `failures` consecutive cache failures (errors or budget overruns) the
gateway stops calling the cache for `cooldown_s`, then lets one probe through; its result
closes or reopens the circuit. A cache that was unreachable is probed as soon as the gateway
has a connection to it again (gateway/cache_path.py:CachePath._cache_back), and one still
starting every STARTING_REPROBE_S until it answers. Coalescer:
identical concurrent misses (same scope and normalised text) share one inference; the others
wait for its answer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanContext

log = logging.getLogger("hopline.gateway")

T = TypeVar("T")


class CircuitState(enum.StrEnum):
    """The breaker's state; its value is what GetStats reports as `cache_circuit`."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Module-level names too: tests/unit/test_gateway_resilience.py imports them.
CLOSED, OPEN, HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


# How often an open circuit probes a cache that answered it is still starting: each probe is
# one lookup refused at once by the starting cache, and the first after it is ready closes the
# circuit.
STARTING_REPROBE_S = 0.25


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = max(1, failures)
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._consecutive = 0
        self._open_until = 0.0
        self._state = CLOSED
        self._probing = False
        self._probe_started = 0.0
        self.opened = 0  # times the circuit opened, for stats
        self._opened_at = 0.0
        self._skipped = 0  # lookups the open circuit skipped, said when it closes

    @property
    def state(self) -> CircuitState:
        if self._state == OPEN and self.clock() >= self._open_until:
            return HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """Whether to call the cache now; in half-open, only one probe at a time.

        A probe whose result never comes back (its caller was cancelled) is given up after
        a cool-down, so a lost probe cannot keep the circuit from ever closing.
        """
        state = self.state
        if state == CLOSED:
            return True
        now = self.clock()
        lost = self._probing and now - self._probe_started >= self.cooldown_s
        if state == HALF_OPEN and (not self._probing or lost):
            self._state, self._probing, self._probe_started = HALF_OPEN, True, now
            return True
        return False

    def skipped(self) -> None:
        """A lookup not sent because the circuit is open (answered FAIL_OPEN)."""
        self._skipped += 1

    def retry_in(self) -> float:
        return max(0.0, self._open_until - self.clock())

    def reconnected(self) -> None:
        """The upstream, unreachable when the circuit opened, has a connection again: the
        circuit's probe may go now instead of at the end of the cool-down."""
        if self._state == OPEN:
            self._open_until = min(self._open_until, self.clock())

    def starting(self) -> None:
        """The probe reached a cache that is still starting (it answered that it is not ready
        yet): probe again in STARTING_REPROBE_S, not at the end of the cool-down. A restarted
        cache binds its port before it loads, so the probe its reconnection let through
        (`reconnected`) found it loading, and its hits came back a whole cool-down (5 s)
        after it served (a durability probe)."""
        if self._state == OPEN:
            self._open_until = min(self._open_until, self.clock() + STARTING_REPROBE_S)

    def success(self) -> None:
        if self._state != CLOSED:
            # Said, as its opening is: the fail-open log's episode counts only the lookups
            # that failed, not the ones the open circuit skipped (an observability probe:
            # 8 said, 734 answered FAIL_OPEN).
            log.info(
                "cache circuit closed",
                extra={
                    "open_s": round(self.clock() - self._opened_at, 3),
                    "lookups_skipped": self._skipped,
                },
            )
        self._consecutive, self._state, self._probing = 0, CLOSED, False

    def inconclusive(self) -> None:
        """The half-open circuit's probe said nothing of the cache's health (its caller's
        deadline cut its budget): neither a failure nor a success, and the next lookup probes
        at once rather than after a lost probe's cool-down. Called for the probe only."""
        self._probing = False

    def failure(self) -> None:
        self._consecutive += 1
        if self._state == HALF_OPEN or self._consecutive >= self.failures:
            if self._state != OPEN:
                self.opened += 1
            if self._state == CLOSED:
                self._opened_at = self.clock()
                self._skipped = 0
                log.warning(
                    "cache circuit opened: lookups skipped (FAIL_OPEN) until a probe answers",
                    extra={"failures": self._consecutive, "cooldown_s": self.cooldown_s},
                )
            self._state, self._probing = OPEN, False
            self._open_until = self.clock() + self.cooldown_s


class Coalescer(Generic[T]):
    def __init__(self) -> None:
        self._inflight: dict[str, asyncio.Future[T]] = {}
        self._waiters: dict[asyncio.Future[T], int] = {}
        # The span each run started under, for its joiners' links: their wait, in a trace of
        # their own, is the leader's hops.
        self._leaders: dict[asyncio.Future[T], SpanContext] = {}
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def running(self, key: str) -> bool:
        """Whether `run(key, ...)` now would join a run already under way."""
        return key in self._inflight

    def leader(self, key: str) -> SpanContext | None:
        """The span the run under way for `key` started under, when it was sampled."""
        task = self._inflight.get(key)
        context = self._leaders.get(task) if task is not None else None
        return context if context is not None and context.trace_flags.sampled else None

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """`work()`'s result and whether it came from another caller's run.

        The shared run is shielded: a caller that gives up (deadline, cancel, a cache hit
        that made a speculative inference useless) does not cancel the answer the others are
        waiting for; when the last one gives up, the run is cancelled. A failure reaches
        every waiter.
        """
        task = self._inflight.get(key)
        shared = task is not None
        if task is None:
            task = self._start(key, work)
        else:
            self.coalesced += 1
        self._waiters[task] += 1
        try:
            return await asyncio.shield(task), shared
        except asyncio.CancelledError:
            left = self._waiters.get(task)  # None once the run has finished
            if left is not None:
                self._waiters[task] = left - 1
                if left == 1:
                    self._forget(key, task)
                    task.cancel()
            raise

    def _start(self, key: str, work: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        task = asyncio.ensure_future(work())
        self._inflight[key] = task
        self._waiters[task] = 0
        self._leaders[task] = trace.get_current_span().get_span_context()

        def _done(t: asyncio.Future[T]) -> None:
            self._forget(key, t)
            if not t.cancelled():
                t.exception()  # retrieved: a failure nobody awaited must not warn at exit

        task.add_done_callback(_done)
        return task

    def _forget(self, key: str, task: asyncio.Future[T]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        self._waiters.pop(task, None)
        self._leaders.pop(task, None)


# -- ejection of a failing replica ------------------------------------------------------------

# gRPC's own outlier detection (the policy's name still carries "_experimental" in grpcio
# 1.85, where it works as round_robin's parent without xDS: measured with one of two replicas
# answering INTERNAL, 22 of the first 100 calls failed and 0 of the next 200). Every address
# of a multi-replica upstream is watched per channel: one whose calls fail at least
# `failure_percent` of the time over an interval (given `min_requests` calls in it) is
# ejected from round_robin for `base_s`, longer each time it is ejected again. Any status
# other than OK counts as a failure, a lookup that overran the cache budget included: a slow
# cache replica is one to move away from too. Never more than half of the addresses, and
# never the last one: a fully failing upstream stays visible as failed calls.
MAX_EJECTION_PERCENT = 50
MAX_EJECTION_S = 300.0


def ejection_service_config(
    failure_percent: int, min_requests: int, interval_s: float, base_s: float
) -> dict[str, Any] | None:
    """The loadBalancingConfig part of an upstream's service config; None when off."""
    if failure_percent <= 0:
        return None
    return {
        "loadBalancingConfig": [
            {
                "outlier_detection_experimental": {
                    "interval": f"{max(interval_s, 0.01):.3f}s",
                    "baseEjectionTime": f"{max(base_s, 0.01):.3f}s",
                    "maxEjectionTime": f"{max(MAX_EJECTION_S, base_s):.3f}s",
                    "maxEjectionPercent": MAX_EJECTION_PERCENT,
                    "failurePercentageEjection": {
                        "threshold": min(failure_percent, 100),
                        "enforcementPercentage": 100,
                        "minimumHosts": 2,
                        "requestVolume": max(min_requests, 1),
                    },
                    "childPolicy": [{"round_robin": {}}],
                }
            }
        ]
    }


def with_ejection(service_config: dict[str, Any] | None, config: Any) -> dict[str, Any] | None:
    """`service_config` (the retry policy, or None) with the gateway config's ejection added."""
    ejection = ejection_service_config(
        config.upstream_eject_failure_percent,
        config.upstream_eject_min_requests,
        config.upstream_eject_interval_s,
        config.upstream_eject_base_s,
    )
    if ejection is None:
        return service_config
    return {**(service_config or {}), **ejection}
