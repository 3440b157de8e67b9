"""Fair shares of a queue between tenants: start-time fair queueing.

A queue served oldest first puts every tenant's request behind the whole backlog of a tenant
that floods: with the gateway's per-tenant share of places (gateway/admission.py) a flood
still held most of them, and the other tenants' misses waited behind its queued rows at the
inference stage (a probe at stop 97: p50 about 300 ms against 12 ms without the flood).

Here each queued item gets a start tag: its flow's previous item's finish tag, or the queue's
virtual time (the largest start tag served so far) when that is later; its finish tag is the
start plus its cost (rows). Items are served in start-tag order, so while several flows wait,
each gets an equal share of the rows served, whatever its backlog: a flow with one request
waiting goes at the next run, not after the flood's hundreds. A flow's own items keep their
arrival order, and with one flow the order is plain arrival order, as before.

The flow is the request's tenant. The gateway's admission sets `FLOW` for the request's task
(a context variable, so it reaches a co-located servicer's batcher without a parameter through
every layer); the cache service sets it from a lookup's scope. Unset, every item is one flow.
A flow is remembered only while it has items waiting, so tenant names never accumulate.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")

FLOW: ContextVar[Hashable] = ContextVar("hopline_flow", default=None)


class VirtualClock:
    """The tags of one set of queues that share their servers (a batcher's length buckets)."""

    def __init__(self) -> None:
        self.now = 0  # the largest start tag served
        self._finish: dict[Hashable, int] = {}  # flows with items waiting: their last finish
        self._waiting: dict[Hashable, int] = {}

    def start(self, flow: Hashable, cost: int) -> int:
        """The start tag of a new item of `flow` costing `cost` rows."""
        start = max(self.now, self._finish.get(flow, 0))
        self._finish[flow] = start + max(1, cost)
        self._waiting[flow] = self._waiting.get(flow, 0) + 1
        return start

    def left(self, flow: Hashable, start: int, served: bool) -> None:
        """An item left its queue: served (virtual time moves on) or given up."""
        if served and start > self.now:
            self.now = start
        left = self._waiting[flow] - 1
        if left:
            self._waiting[flow] = left
        else:
            del self._waiting[flow]
            del self._finish[flow]

    @property
    def flows(self) -> int:
        """Flows with items waiting."""
        return len(self._waiting)


class FairQueue(Generic[T]):
    """Items in start-tag order (module docstring); one flow's items in arrival order."""

    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        # (start, arrival, flow, item): start and arrival order it; the item is never compared.
        self._heap: list[tuple[int, int, Hashable, T]] = []
        self._arrivals = itertools.count()

    def push(self, item: T, flow: Hashable = None, cost: int = 1) -> None:
        start = self.clock.start(flow, cost)
        heapq.heappush(self._heap, (start, next(self._arrivals), flow, item))

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        """Every item, in no particular order."""
        return (entry[3] for entry in self._heap)

    def head(self) -> T:
        return self._heap[0][3]

    def head_tag(self) -> int:
        return self._heap[0][0]

    def pop(self, served: bool = True) -> T:
        """The head, leaving to be served (or, `served=False`, because its caller gave up)."""
        start, _, flow, item = heapq.heappop(self._heap)
        self.clock.left(flow, start, served)
        return item

    def prune(self, gone: Callable[[T], bool]) -> list[T]:
        """Removes and returns every item `gone` says was given up."""
        kept: list[tuple[int, int, Hashable, T]] = []
        dropped: list[T] = []
        for entry in self._heap:
            if gone(entry[3]):
                self.clock.left(entry[2], entry[0], served=False)
                dropped.append(entry[3])
            else:
                kept.append(entry)
        if dropped:
            heapq.heapify(kept)
            self._heap = kept
        return dropped

    def clear(self) -> list[T]:
        """Removes and returns every item (shutdown)."""
        return self.prune(lambda _: True)
