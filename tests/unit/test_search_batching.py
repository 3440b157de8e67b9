"""cache/search_batching.py: when searches of one scope share a Milvus call, and that each
still gets its own answer, its own failure or nothing after giving up. The search here is a
recording coroutine the test releases by hand, so the moments searches meet are chosen;
tests/mesh/test_cache_search_batching.py runs the real cache over milvus-lite."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from hopline.cache.embedder import Vector
from hopline.cache.search_batching import Found, SearchBatcher, Searched
from hopline.cache.store import Entry, Scope

A: Scope = ("t", "m", "1", "top_k=1")
B: Scope = ("t", "m", "2", "top_k=1")


class Milvus:
    """Answers each vector with its own first element, after the test releases the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Scope, list[float], float]] = []
        self.release = asyncio.Event()
        self.fail: Exception | None = None

    async def search(
        self, vectors: Sequence[Vector], scope: Scope, now: float, limit: int
    ) -> list[Found]:
        self.calls.append((scope, [float(v[0]) for v in vectors], now))
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return [[(_entry(float(v[0])), 1.0)] for v in vectors]


def _entry(tag: float) -> Entry:
    return Entry(str(tag), A, "text", b"", 0.0, 1e12)


def v(x: float) -> Vector:
    return np.array([x, 0.0], dtype=np.float32)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_lone_search_goes_at_once_and_later_ones_share_the_next_call() -> None:
    async def main() -> None:
        milvus = Milvus()
        batcher = SearchBatcher(milvus.search, max_in_flight=1)
        first = asyncio.create_task(batcher.search(v(1), A, 10.0, 4))
        await _settle()
        assert [c[1] for c in milvus.calls] == [[1.0]]  # alone, without waiting for company
        rest = [asyncio.create_task(batcher.search(v(x), A, 10.0 + x, 4)) for x in (2, 3, 4)]
        await _settle()
        assert len(milvus.calls) == 1  # they wait while the first is out
        milvus.release.set()
        answers = await asyncio.gather(first, *rest)
        assert [a.found[0][0].key for a in answers] == ["1.0", "2.0", "3.0", "4.0"]
        assert [a.rows for a in answers] == [1, 3, 3, 3]  # what each search's span reports
        assert [c[1] for c in milvus.calls] == [[1.0], [2.0, 3.0, 4.0]]
        assert milvus.calls[1][2] == 14.0  # the batch filters on its latest `now`
        assert (batcher.calls, batcher.searches) == (2, 4)

    asyncio.run(main())


def test_other_scopes_do_not_wait_and_the_in_flight_limit_is_per_scope() -> None:
    async def main() -> None:
        milvus = Milvus()
        batcher = SearchBatcher(milvus.search, max_in_flight=2)
        tasks = [asyncio.create_task(batcher.search(v(x), A, 0.0, 4)) for x in (1, 2, 3)]
        tasks.append(asyncio.create_task(batcher.search(v(9), B, 0.0, 4)))
        await _settle()
        assert [(c[0], c[1]) for c in milvus.calls] == [(A, [1.0]), (A, [2.0]), (B, [9.0])]
        milvus.release.set()
        await asyncio.gather(*tasks)
        assert [(c[0], c[1]) for c in milvus.calls][3:] == [(A, [3.0])]

    asyncio.run(main())


def test_a_caller_that_gave_up_is_not_searched_and_rows_are_capped() -> None:
    async def main() -> None:
        milvus = Milvus()
        batcher = SearchBatcher(milvus.search, max_in_flight=1, max_rows=2)
        first = asyncio.create_task(batcher.search(v(1), A, 0.0, 4))
        await _settle()
        waiting = [asyncio.create_task(batcher.search(v(x), A, 0.0, 4)) for x in (2, 3, 4, 5)]
        await _settle()
        waiting[0].cancel()  # the lookup budget ran out
        milvus.release.set()
        await first
        done = await asyncio.gather(*waiting, return_exceptions=True)
        assert isinstance(done[0], asyncio.CancelledError)
        searched = [d for d in done[1:] if isinstance(d, Searched)]
        assert [d.found[0][0].key for d in searched] == ["3.0", "4.0", "5.0"]
        assert [d.rows for d in searched] == [2, 2, 1]
        assert [c[1] for c in milvus.calls] == [[1.0], [3.0, 4.0], [5.0]]

    asyncio.run(main())


def test_a_failed_call_fails_every_search_in_it_and_the_next_ones_still_go() -> None:
    async def main() -> None:
        milvus = Milvus()
        batcher = SearchBatcher(milvus.search, max_in_flight=1)
        milvus.fail = RuntimeError("milvus is down")
        first = asyncio.create_task(batcher.search(v(1), A, 0.0, 4))
        await _settle()
        batch = [asyncio.create_task(batcher.search(v(x), A, 0.0, 4)) for x in (2, 3)]
        await _settle()
        milvus.release.set()
        for task in (first, *batch):
            with pytest.raises(RuntimeError, match="milvus is down"):
                await task
        milvus.fail = None
        assert (await batcher.search(v(7), A, 0.0, 4)).found[0][0].key == "7.0"

    asyncio.run(main())
