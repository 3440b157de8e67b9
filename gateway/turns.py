"""Places in flight for one caller's many requests (a stream's messages, a batch's texts), as
many at once as `width()` says at the moment each is taken.

A semaphore is sized once. A stream lives for hours, and the width it should have changes
while it is open: a stream opened while its tenant had the gateway to itself may put the
gateway's whole limit in flight, and once another tenant has come only its tenant's
always-left places (gateway/admission.py:batch_width), else its own requests past its
tenant's share are refused by it. Sized at the first request, a stream kept the whole limit
for good after the second tenant came (stop 101's note). Read at each take, the width only
stops new turns: the ones taken run to their end.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hopline.gateway.admission import Admission


class Turns:
    """At most `width()` turns taken at once; None from `width` is no bound. A take may weigh
    several turns (a stream's request counted by its texts); one heavier than the width is
    taken alone. Waiters are served first come, first served: a freed turn goes to the
    longest waiting."""

    def __init__(self, width: Callable[[], int | None]) -> None:
        self._width = width
        self._taken = 0
        self._waiters: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()

    @property
    def taken(self) -> int:
        return self._taken

    def _room(self, weight: int) -> bool:
        width = self._width()
        return width is None or self._taken == 0 or self._taken + weight <= width

    async def acquire(self, weight: int = 1) -> None:
        if not self._waiters and self._room(weight):
            self._taken += weight
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (waiter, weight)
        self._waiters.append(entry)
        try:
            await waiter  # `_hand_on` counts the turns as taken before it wakes this
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(weight)  # handed its turns, then cancelled: they go on
            else:
                if entry in self._waiters:  # `_hand_on` drops a cancelled one it meets
                    self._waiters.remove(entry)
                self._hand_on()
            raise

    def release(self, weight: int = 1) -> None:
        self._taken -= weight
        self._hand_on()

    def _hand_on(self) -> None:
        while self._waiters and self._room(self._waiters[0][1]):
            waiter, weight = self._waiters.popleft()
            if not waiter.done():
                self._taken += weight
                waiter.set_result(None)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *_: object) -> None:
        self.release()


class StreamTurns:
    """The turns a ModelStreamInfer stream's texts take, whatever requests carry them: counted
    by requests, 32 requests of 16 texts put 512 of one stream in flight against the gateway's
    limit of 256 (a reviewer's reproduction). The tenant is the stream's first request's; the
    width is read at each turn (`Turns`): `Admission.stream_width`, at most half the
    gateway's places, its tenant's always-left ones once another tenant has sent."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._turns: Turns | None = None

    def for_tenant(self, tenant: str) -> Turns:
        if self._turns is None:
            admission = self._admission
            self._turns = Turns(lambda: admission.stream_width(tenant))
        return self._turns
