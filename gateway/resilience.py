"""What keeps the cache from making the mesh slower or less available.

CircuitBreaker: after `failures` consecutive cache failures (errors or budget overruns) the
gateway stops calling the cache for `cooldown_s`, then lets one probe through; its result
closes or reopens the circuit. Coalescer: identical concurrent misses (same scope and
normalised text) share one inference; the others wait for its answer.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CircuitState(enum.StrEnum):
    """The breaker's state; its value is what GetStats reports as `cache_circuit`."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Module-level names too: tests/unit/test_gateway_resilience.py imports them.
CLOSED, OPEN, HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


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

    def retry_in(self) -> float:
        return max(0.0, self._open_until - self.clock())

    def success(self) -> None:
        self._consecutive, self._state, self._probing = 0, CLOSED, False

    def failure(self) -> None:
        self._consecutive += 1
        if self._state == HALF_OPEN or self._consecutive >= self.failures:
            if self._state != OPEN:
                self.opened += 1
            self._state, self._probing = OPEN, False
            self._open_until = self.clock() + self.cooldown_s


class Coalescer(Generic[T]):
    def __init__(self) -> None:
        self._inflight: dict[str, asyncio.Future[T]] = {}
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._inflight)

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """`work()`'s result and whether it came from another caller's run.

        The shared run is shielded: a caller that gives up (deadline, cancel) does not cancel
        the answer the others are waiting for. A failure reaches every waiter.
        """
        running = self._inflight.get(key)
        if running is not None:
            self.coalesced += 1
            return await asyncio.shield(running), True
        task = asyncio.ensure_future(work())
        self._inflight[key] = task

        def _done(t: asyncio.Future[T]) -> None:
            if self._inflight.get(key) is t:
                del self._inflight[key]
            if not t.cancelled():
                t.exception()  # retrieved: a failure nobody awaited must not warn at exit

        task.add_done_callback(_done)
        return await asyncio.shield(task), False
