"""Semantic searches of one scope that wait at the same moment go to Milvus as one call.

A search with nothing of its scope in flight goes at once, alone: a lone lookup never waits
for company. While `max_in_flight` calls of a scope are out, later searches of that scope
queue, and the next call to finish sends them all (up to `max_rows`) as one multi-vector
search. On milvus-lite over 5,000 entries one search costs 2.75 ms and sixteen in one call
5.77 ms (0.36 ms each), so under load the semantic tier's queue drains many times faster:
at concurrency 32 through a co-located mesh, 119 against 92-97 rps with every search alone
(docs/cache.md).

A batch filters on the latest `now` of its searches (entries must outlive every one of
them), which differs from each search's own by the milliseconds they waited. A search
whose caller gave up (the lookup budget) is dropped from its batch's answers; a failed call
fails every search in it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from hopline.cache.embedder import Vector
from hopline.cache.keys import scope_digest
from hopline.cache.store import Entry, Scope
from hopline.observability import metrics

Found = list[tuple[Entry, float]]
Search = Callable[[Sequence[Vector], Scope, float, int], Awaitable[list[Found]]]


class Searched(NamedTuple):
    found: Found
    rows: int  # searches the Milvus call answered, this one included (1: it went alone)


@dataclasses.dataclass
class _Waiting:
    scope: Scope
    limit: int
    vectors: list[Vector] = dataclasses.field(default_factory=list)
    nows: list[float] = dataclasses.field(default_factory=list)
    answers: list[asyncio.Future[Searched]] = dataclasses.field(default_factory=list)

    def subset(self, rows: list[int]) -> _Waiting:
        return _Waiting(
            self.scope,
            self.limit,
            [self.vectors[i] for i in rows],
            [self.nows[i] for i in rows],
            [self.answers[i] for i in rows],
        )


class SearchBatcher:
    def __init__(self, search: Search, *, max_in_flight: int, max_rows: int = 64) -> None:
        if max_rows < 1:  # read from the environment: fail start-up saying which setting
            raise SystemExit(f"HOPLINE_CACHE_SEARCH_BATCH_ROWS must be at least 1, got {max_rows}")
        self._search = search
        self._max_in_flight = max_in_flight
        self._max_rows = max_rows
        self._in_flight: dict[tuple[str, int], int] = {}
        self._waiting: dict[tuple[str, int], _Waiting] = {}
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references
        self.calls = 0  # Milvus calls made
        self.searches = 0  # searches answered through them

    async def search(self, vector: Vector, scope: Scope, now: float, limit: int) -> Searched:
        key = (scope_digest(scope), limit)
        if self._in_flight.get(key, 0) < self._max_in_flight:
            (found,) = await self._call(key, scope, [vector], now, limit)
            return Searched(found, 1)
        waiting = self._waiting.setdefault(key, _Waiting(scope, limit))
        answer: asyncio.Future[Searched] = asyncio.get_running_loop().create_future()
        waiting.vectors.append(vector)
        waiting.nows.append(now)
        waiting.answers.append(answer)
        return await answer

    async def _call(
        self, key: tuple[str, int], scope: Scope, vectors: list[Vector], now: float, limit: int
    ) -> list[Found]:
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self.calls += 1
        self.searches += len(vectors)
        metrics.CACHE_SEARCH_ROWS.observe(len(vectors))
        try:
            return await self._search(vectors, scope, now, limit)
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]
            self._send_waiting(key)

    def _send_waiting(self, key: tuple[str, int]) -> None:
        waiting = self._waiting.pop(key, None)
        if waiting is None:
            return
        # Callers that gave up while waiting are not searched for.
        keep = [i for i, a in enumerate(waiting.answers) if not a.done()]
        if rest := keep[self._max_rows :]:
            self._waiting[key] = waiting.subset(rest)
        if taken := keep[: self._max_rows]:
            task = asyncio.get_running_loop().create_task(self._send(key, waiting.subset(taken)))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, key: tuple[str, int], batch: _Waiting) -> None:
        try:
            results = await self._call(
                key, batch.scope, batch.vectors, max(batch.nows), batch.limit
            )
        except Exception as exc:
            for answer in batch.answers:
                if not answer.done():
                    answer.set_exception(exc)
            return
        except BaseException:
            for answer in batch.answers:
                answer.cancel()
            raise
        for answer, found in zip(batch.answers, results, strict=True):
            if not answer.done():
                answer.set_result(Searched(found, len(results)))
