"""Hedged stage calls: an RPC that its replica holds far longer than the stage's calls take
is sent again, on the next replica, and the first answer is taken.

Why: a hung replica (a stopped process, a long pause, a machine swapping) neither answers
nor fails, so gRPC's retries (they need a status) and ejection (it counts failures) leave
its calls where they are; gRPC notices only when a keepalive ping goes unanswered, up to
15 s later (gateway/upstream.py:KEEPALIVE_TIMEOUT_MS). With one RPC per stage and model on
its way (HOPLINE_GATEWAY_BATCH_IN_FLIGHT) every miss behind that call waited as long. gRPC
core implements retries but not gRFC A6's hedging policy, so the gateway hedges itself.
Every stage (tokenize, inference, postprocess) answers a request the same way twice, so a
second copy is safe.

When: an attempt unanswered after `delay_s()` (HEDGE_P99_FACTOR times the stage's p99 over
its last RECENT calls, at least HOPLINE_UPSTREAM_HEDGE_MIN_MS) gets another, up to
HOPLINE_UPSTREAM_HEDGE_ATTEMPTS attempts in all, within the call's deadline.

Where: a hedge goes to one replica by its own channel (`replicas`: the upstream's
`replica_stubs`), never to one this call's hedges went to already, first to a replica whose
hedge answered first lately and last to one whose hedge was itself left unanswered lately.
Sent on round_robin's next pick instead, with other callers' picks between, it was the hung
replica again about half the time: with two replicas and seven callers, a third attempt on
the hung one too, or the budget spent, and every caller waited 5 s for the connection to
drop (a helper's probe, two runs of four). Without replicas to name (a host name not yet
resolved), round_robin's next pick. The first reply is the call's; the attempts
left are cancelled. Hedges are budgeted as gRPC's retry throttling budgets retries: a hedge
spends a token, an answered call gives back a tenth of one, and a hedge that answered first
gives its token back (it replaced a call that was doing nothing): so hedging around a hung
replica goes on for as long as it pays, and hedges that do not pay (an upstream slow
everywhere) stay near a tenth of the calls.

What a call costs: a set entry, a span lookup, and a timer per stage while calls are on
their way (not one per call); the p99 is sorted once every RECENT // 8 replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry import trace

from hopline.observability import metrics, schema

log = logging.getLogger("hopline.gateway.hedging")

Rep = TypeVar("Rep")

RECENT = 256  # replies whose durations make the stage's p99
MIN_SAMPLES = 20  # no hedging before this many replies: no p99 to judge by yet
HEDGE_P99_FACTOR = 4.0  # an attempt this many p99s old is taken as stuck
# The budget, in tenths of a hedge (whole numbers: a float sum of tenths fell just short of
# a whole hedge and refused it): its size (and start), and what each answered call gives back.
TOKENS = 100
TOKEN_RATIO = 1
HEDGE = 10  # what one hedge spends
# Suspect mode's hedges (sent at once, not for a call seen stuck) leave this much of the
# budget to hedge calls that are stuck: with three replicas two in three of its hedges are
# wasted, and once they had spent the budget a call stuck on the hung replica got no hedge
# and held its stage until the connection dropped (5-6 s; a helper's probe).
SUSPECT_RESERVE = 5 * HEDGE
LOG_EVERY_S = 10.0  # hedges are counted in the metrics; logged at most this often per hop
# After a hedge answered first, calls for this long send their second attempt at once: the
# hung replica is still in round_robin's turn, and a call's two attempts are consecutive
# picks, so one of them reaches a live replica. Waiting the delay again instead held every
# call whose first pick was the hung one (with one caller and two replicas, each of them:
# the hedge took the live replica's turn, the next call's first pick the hung one's).
SUSPECT_S = 1.0
# A replica whose hedge answered first is preferred for this long, and one whose hedge was
# left unanswered (its call needed another attempt) avoided for this long.
REPLICA_MEMORY_S = 5.0
MAX_REMEMBERED = 64  # replicas remembered before the expired ones are dropped

# The upstream's replicas as (address, the stub method on a channel to that one replica).
Replicas = Callable[[], Sequence[tuple[str, Callable[..., Any]]]]


class HedgeResult(enum.StrEnum):
    SENT = "sent"
    ANSWERED = "answered"  # the hedge's reply was the call's


@dataclasses.dataclass(eq=False)
class _Call:
    request: Any
    metadata: tuple[tuple[str, str | bytes], ...]
    deadline: float  # monotonic
    first: Any  # the grpc.aio call the caller awaits
    span: trace.Span
    next_at: float  # when the next attempt is due, monotonic
    attempts: int = 1
    hedges: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)
    # The replicas its hedges went to, each with its hedge.
    tried: dict[str, asyncio.Task[None]] = dataclasses.field(default_factory=dict)
    reply: Any = None
    answered_by_hedge: bool = False


class Hedging(Generic[Rep]):
    """Calls a stub method as `send()(request, timeout=, metadata=)`, hedged as above."""

    def __init__(
        self,
        hop: str,
        send: Callable[[], Callable[..., Any]],
        attempts: int,
        min_delay_s: float,
        replicas: Replicas | None = None,
    ) -> None:
        self.hop = hop
        self._send = send
        self._replicas = replicas
        self._answered_at: dict[str, float] = {}  # replica -> when its hedge last answered first
        self._unanswered_at: dict[str, float] = {}  # replica -> when its hedge was left waiting
        self._turn = 0
        self._attempts = attempts
        self._min_delay_s = min_delay_s
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._since_sorted = 0
        self._delay_s: float | None = None  # None: too few replies yet
        self._tokens = TOKENS  # tenths of a hedge
        self._open: set[_Call] = set()
        self._suspect_until = 0.0  # monotonic: a hedge answered first this recently
        self._timer: asyncio.TimerHandle | None = None
        self._logged = 0.0
        self._unlogged = [0, 0]  # hedges sent, hedges that answered first, since the last log
        self._unlogged_since = 0.0  # when the first of them was sent

    def delay_s(self) -> float | None:
        """How long an attempt is given before the next is sent; None before MIN_SAMPLES."""
        return self._delay_s

    async def __call__(
        self,
        request: Any,
        *,
        timeout: float,  # noqa: ASYNC109 (a stub's signature: the call's deadline)
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Rep:
        metadata = tuple(metadata)
        started = time.monotonic()
        first = self._send()(request, timeout=timeout, metadata=metadata)
        delay = self._delay_s
        if delay is None:
            reply: Rep = await first
            self._answered(time.monotonic() - started)
            return reply
        call = _Call(
            request, metadata, started + timeout, first, trace.get_current_span(), started + delay
        )
        self._open.add(call)
        if started < self._suspect_until:
            self._launch(call, started, reserve=SUSPECT_RESERVE)
        self._arm(delay)
        try:
            reply = await first
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.answered_by_hedge and task is not None and not task.cancelling():
                return self._hedge_answered(call)
            raise
        except grpc.aio.AioRpcError as err:
            if call.answered_by_hedge:  # in the same turn of the loop as this failure
                return self._hedge_answered(call)
            if all(hedge.done() for hedge in call.hedges):
                raise
            return await self._hedges_answer(call, err)  # the stuck attempt failed first
        finally:
            self._open.discard(call)
            for hedge in call.hedges:
                hedge.cancel()
        self._answered(time.monotonic() - started)
        return reply

    def _answered(self, seconds: float) -> None:
        """A first attempt answered: its time joins the stage's recent ones."""
        self._tokens = min(TOKENS, self._tokens + TOKEN_RATIO)
        self._recent.append(seconds)
        self._since_sorted += 1
        if self._since_sorted >= RECENT // 8 or self._delay_s is None:
            self._sort()

    def _sort(self) -> None:
        self._since_sorted = 0
        if len(self._recent) < MIN_SAMPLES:
            return
        ordered = sorted(self._recent)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        self._delay_s = max(self._min_delay_s, HEDGE_P99_FACTOR * p99)

    def _arm(self, delay: float) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        """Send the next attempt of every call whose time is up, then wait for the next one."""
        self._timer = None
        now = time.monotonic()
        delay = self._delay_s or self._min_delay_s
        for call in list(self._open):
            if call.next_at > now or call.first.done():
                continue
            call.next_at = now + delay
            self._launch(call, now)
        if self._open:
            wait = min(c.next_at for c in self._open) - now
            self._timer = asyncio.get_running_loop().call_later(max(wait, 0.001), self._tick)
        self._log(now, delay)

    def _launch(self, call: _Call, now: float, reserve: int = 0) -> None:
        """Send `call`'s next attempt, if it has one left, time left, and the budget a hedge
        beyond `reserve`."""
        for address, sent in call.tried.items():
            if not sent.done():  # the call is due another attempt: this hedge did not answer
                self._unanswered_at[address] = now
        if call.attempts >= self._attempts or call.deadline - now <= 0:
            return
        if self._tokens < HEDGE + reserve:
            return
        self._tokens -= HEDGE
        call.attempts += 1
        call.span.set_attribute(schema.HEDGE_ATTEMPTS, call.attempts)
        metrics.hedges(self.hop, HedgeResult.SENT).inc()
        if not self._unlogged[0]:
            self._unlogged_since = now
        self._unlogged[0] += 1
        replica, send = self._pick(call, now)
        hedge = asyncio.ensure_future(self._hedge(call, replica, send))
        call.hedges.append(hedge)
        if replica is not None:
            call.tried[replica] = hedge

    def _pick(self, call: _Call, now: float) -> tuple[str | None, Callable[..., Any]]:
        """The replica for `call`'s next hedge, and its stub method (module docstring)."""
        named = self._replicas() if self._replicas is not None else ()
        replicas = [r for r in named if r[0] not in call.tried]
        if not replicas:
            return None, self._send()
        self._forget(now)
        self._turn = (self._turn + 1) % len(replicas)
        turn = replicas[self._turn :] + replicas[: self._turn]

        def rank(replica: tuple[str, Callable[..., Any]]) -> tuple[bool, bool]:
            address = replica[0]
            avoided = now - self._unanswered_at.get(address, -math.inf) < REPLICA_MEMORY_S
            preferred = now - self._answered_at.get(address, -math.inf) < REPLICA_MEMORY_S
            return avoided, not preferred

        return min(turn, key=rank)  # the first in turn among the best ranked

    def _forget(self, now: float) -> None:
        """Drop what is no longer remembered, once there is much of it (replicas come and go
        behind a name)."""
        for seen in (self._answered_at, self._unanswered_at):
            if len(seen) > MAX_REMEMBERED:
                for address in [a for a, at in seen.items() if now - at >= REPLICA_MEMORY_S]:
                    del seen[address]

    async def _hedge(self, call: _Call, replica: str | None, send: Callable[..., Any]) -> None:
        left = call.deadline - time.monotonic()
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await send(call.request, timeout=left, metadata=call.metadata)
            if call.answered_by_hedge:
                return  # another hedge answered first
            call.reply, call.answered_by_hedge = reply, True
            if replica is not None:
                self._answered_at[replica] = time.monotonic()
                self._unanswered_at.pop(replica, None)
            call.first.cancel()  # the caller's await ends (a no-op once it has ended)

    def _hedge_answered(self, call: _Call) -> Rep:
        """The call's reply is a hedge's: it replaced an attempt that was doing nothing, so
        its token comes back."""
        self._tokens = min(TOKENS, self._tokens + HEDGE)
        self._suspect_until = time.monotonic() + SUSPECT_S
        metrics.hedges(self.hop, HedgeResult.ANSWERED).inc()
        self._unlogged[1] += 1
        self._log(time.monotonic(), self._delay_s or self._min_delay_s)
        return call.reply  # type: ignore[no-any-return]

    async def _hedges_answer(self, call: _Call, failure: grpc.aio.AioRpcError) -> Rep:
        """The first attempt failed while hedges are on their way: the first of them to
        answer, or the first attempt's failure if none does."""
        await asyncio.wait(call.hedges)
        if call.answered_by_hedge:
            return self._hedge_answered(call)
        raise failure

    def _log(self, now: float, delay: float) -> None:
        sent, answered = self._unlogged
        if not sent or now - self._logged < LOG_EVERY_S:
            return
        if self._replicas is not None and not answered and now - self._unlogged_since < 1.0:
            return  # a hedge's answer, soon, names the replicas that answer
        # The replicas seen since the hedges this line counts began (REPLICA_MEMORY_S is
        # shorter than LOG_EVERY_S: answers counted, their replicas forgotten; a re-run).
        since = min(self._unlogged_since, now - REPLICA_MEMORY_S)
        self._logged, self._unlogged = now, [0, 0]

        def recent(seen: dict[str, float]) -> list[str]:
            return sorted(a for a, at in seen.items() if at >= since)

        # Which replica holds the first attempts is round_robin's secret; those that answered
        # hedges, and those whose hedges were not answered either, say which one to look at
        # (the line named none: an SRE could not tell which replica to drain; a probe).
        # No hedge answered first: the other replicas were as slow, an overload's sign, not
        # a hung one's (the question alone was asked under plain overload: an SRE's probe).
        question = (
            "is one hung?"
            if answered
            else "no hedge answered first: every replica is slow (overloaded?), not one hung"
        )
        log.warning(
            f"{self.hop} calls unanswered after {delay * 1e3:.0f} ms were sent again on the "
            f"next replica: {question}",
            extra={
                "hop": self.hop,
                "hedges": sent,
                "answered_by_hedge": answered,
                "hedges_answered_by": recent(self._answered_at),
                "hedges_unanswered_by": recent(self._unanswered_at),
            },
        )

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for call in self._open:
            for hedge in call.hedges:
                hedge.cancel()
