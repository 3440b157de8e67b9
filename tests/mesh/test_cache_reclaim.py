"""milvus-lite keeps the rows the cache deletes in memory, so the store reclaims them: it copies
the live rows to the next generation of its collection and drops the old one. Real milvus-lite
files throughout; the cache service test runs the real CacheService and gRPC server in this
process so its counters can be read.

One seam: `after_copy` wraps the store's copy so that writes are made, deterministically,
after the copy has read the old generation and before the switch, so only the reclaim's
journal can carry them to the new one (the window a real writer hits by chance); the copy
itself is the real one.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_service import cache, lookup, scope, store, store_batch, written

from hopline.cache import generations
from hopline.cache.counts import CacheCount
from hopline.cache.entry_bounds import HEADROOM
from hopline.cache.generations import generation_name
from hopline.cache.milvus_rows import to_row
from hopline.cache.milvus_store import RECLAIM_MIN_DEAD, MilvusStore
from hopline.cache.store import Entry, ScopeFilter, Vector
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

BASE = "reclaim_test"
DIM = 8


def key(i: int) -> str:
    return hashlib.sha256(f"entry {i}".encode()).hexdigest()


def entry(i: int, tenant: str = "a", answer: bytes = b"first", ttl_s: float = 600) -> Entry:
    now = time.time()
    return Entry(key(i), (tenant, "m", "1", "{}"), f"text {i}", answer, now, now + ttl_s)


def vector(i: int) -> Vector:
    v = np.random.default_rng(i).standard_normal(DIM).astype(np.float32)
    return (v / np.linalg.norm(v)).astype(np.float32)


def fill(s: MilvusStore, ids: range, **kw: Any) -> None:
    for start in range(ids.start, ids.stop, 500):
        s.upsert([(entry(i, **kw), vector(i)) for i in range(start, min(start + 500, ids.stop))])


@contextmanager
def opened(db: Path, ratio: float = 1.0) -> Iterator[MilvusStore]:
    s = MilvusStore(str(db), BASE, DIM, reclaim_ratio=ratio)
    try:
        yield s
    finally:
        s.close()


def collections(s: MilvusStore) -> list[str]:
    assert s._client is not None
    return sorted(s._client.list_collections())


def test_a_reclaim_keeps_every_live_entry_and_drops_the_old_generation(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"
    live = range(2000, 2300)
    with opened(db) as s:
        fill(s, range(0, live.stop))
        fill(s, range(5000, 5020), ttl_s=0.5)  # expired by the reclaim: not copied
        assert s.delete([key(i) for i in range(0, 1000)]) == RECLAIM_MIN_DEAD
        assert s.reclaim(time.time()) is None  # 1000 deleted < 1.0 x 1320 live
        s.delete([key(i) for i in range(1000, live.start)])
        fill(s, range(live.start, live.start + 100), answer=b"second")  # 100 rows replaced
        time.sleep(0.6)
        done = s.reclaim(time.time())
        assert done is not None
        assert (done.collection, done.copied, done.freed) == (f"{BASE}_g1", 300, 2100)
        assert collections(s) == [f"{BASE}_g1"]
        now = time.time()
        for i in live:
            got = s.get(key(i), now)
            assert got is not None, i
            assert got.response == (b"second" if i < live.start + 100 else b"first")
            assert got.text == f"text {i}"
        assert all(s.get(key(i), now) is None for i in (0, 1999, 5000))
        (nearest, other) = s.search(
            [vector(live.start + 7), vector(live.start + 9)], entry(0).scope, now, 1
        )
        assert nearest[0][0].key == key(live.start + 7)
        assert nearest[0][1] == pytest.approx(1.0, abs=1e-5)
        assert other[0][0].key == key(live.start + 9)  # one call, each vector its own answer
        assert s.count() == 300
        assert s.reclaim(time.time()) is None  # nothing deleted since
    with opened(db) as s:  # a restart opens the new generation
        assert s.collection == f"{BASE}_g1"
        assert s.count() == 300


def test_nothing_is_reclaimed_when_off_or_not_worth_it(tmp_path: Path) -> None:
    with opened(tmp_path / "off.db", ratio=0.0) as s:
        fill(s, range(0, 1500))
        s.delete([key(i) for i in range(0, 1400)])
        assert s.reclaim(time.time()) is None
        assert collections(s) == [BASE]
    with opened(tmp_path / "few.db") as s:  # more deleted than live, but under the minimum
        fill(s, range(0, 600))
        s.delete([key(i) for i in range(0, 500)])
        assert s.reclaim(time.time()) is None


@contextmanager
def after_copy(s: MilvusStore, writes: Callable[[], None]) -> Iterator[None]:
    """`writes` runs once the reclaim's copy has read the old generation, before the switch."""
    copy = s._copy_live

    def then_write(source: str, target: str, now: float) -> int:
        copied = copy(source, target, now)
        writes()
        return copied

    s._copy_live = then_write  # type: ignore[method-assign]
    try:
        yield
    finally:
        s._copy_live = copy  # type: ignore[method-assign]


def test_writes_made_during_a_reclaim_reach_the_new_generation(tmp_path: Path) -> None:
    with opened(tmp_path / "cache.db") as s:
        fill(s, range(0, 2000))
        fill(s, range(9000, 9050), tenant="b")
        s.delete([key(i) for i in range(0, 1500)])
        stop = threading.Event()
        added: list[int] = []
        removed: list[int] = []

        def late_writes() -> None:
            s.upsert([(entry(1500, answer=b"replaced"), vector(1500))])
            fill(s, range(3000, 3010))
            s.delete([key(i) for i in range(1501, 1511)])
            s.delete_scope(ScopeFilter(tenant="b"))

        def during_copy() -> None:
            i = 4000
            while not stop.is_set():
                fill(s, range(i, i + 5))
                added.extend(range(i, i + 5))
                s.delete([key(i)])
                removed.append(i)
                i += 5

        writer = threading.Thread(target=during_copy)
        with after_copy(s, late_writes):
            writer.start()
            try:
                done = s.reclaim(time.time())
            finally:
                stop.set()
                writer.join()
        assert done is not None
        assert done.replayed >= 4
        now = time.time()
        got = s.get(key(1500), now)
        assert got is not None
        assert got.response == b"replaced"
        expected = {*range(1511, 2000), *range(3000, 3010), *added} - set(removed)
        missing = [i for i in sorted(expected) if s.get(key(i), now) is None]
        assert missing == []
        gone = [*range(1501, 1511), *range(9000, 9050), *removed]
        assert [i for i in gone if s.get(key(i), now) is not None] == []
        assert s.count() == len(expected) + 1  # 1500, replaced


def test_an_unfinished_reclaim_is_dropped_and_a_finished_one_kept(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"
    with opened(db) as s:
        fill(s, range(0, 50))
        s._create(generation_name(BASE, 1))  # a copy the process died in the middle of
    with opened(db) as s:
        assert s.collection == BASE
        assert collections(s) == [BASE]
        assert s.count() == 50
        s._create(generation_name(BASE, 1))
        assert s._client is not None
        s._client.load_collection(generation_name(BASE, 1))
        finished = [to_row(entry(i), vector(i)) for i in range(0, 50)]
        s._client.insert(generation_name(BASE, 1), finished)
        s._client.drop_collection(BASE)  # and its commit
    with opened(db) as s:
        assert s.collection == f"{BASE}_g1"
        assert s.count() == 50


def test_the_cache_service_reclaims_under_eviction_and_keeps_serving(tmp_path: Path) -> None:
    """Stores past a small bound evict; once the evicted rows pass the live ones (and 1000),
    the service's reclaim task copies the live entries and lookups go on hitting."""

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            texts = [f"question number {i} about an order" for i in range(1300)]
            for start in range(0, len(texts), 50):
                await asyncio.gather(
                    *(
                        store(stub, t, max_entries=200, mode="semantic")
                        for t in texts[start : start + 50]
                    )
                )
            await written(stub)
            deadline = time.monotonic() + 30
            while not (stats := await stub.GetStats(cache_pb2.GetStatsRequest())).reclaims:
                assert time.monotonic() < deadline, "no reclaim within 30 s"
                await asyncio.sleep(0.2)
            assert stats.evictions >= 1000
            assert isinstance(service.store, MilvusStore)
            assert service.store.collection.endswith("_g1")
            assert (await lookup(stub, texts[-1])).outcome == common_pb2.CACHE_OUTCOME_EXACT
            # The semantic tier searches the new generation's vectors.
            near = await lookup(
                stub, "Question number 1299 about my order", mode="semantic", threshold=0.8
            )
            assert near.outcome == common_pb2.CACHE_OUTCOME_SEMANTIC
            # Over its bound a scope gives up its oldest down to HEADROOM below it.
            entries = (await stub.GetStats(cache_pb2.GetStatsRequest())).entries
            assert 200 - int(200 * HEADROOM) <= entries <= 200

    asyncio.run(body())


@pytest.mark.parametrize("drained", [False, True], ids=["reclaim-ends", "drain-first"])
def test_stores_wait_while_a_reclaims_journal_is_full_and_land_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drained: bool
) -> None:
    """A copy under a stream of stores records every write for the new generation; past
    JOURNAL_MAX_ROWS (20 here) the writer holds the stores back (still answered from the
    pending buffer) until the reclaim ends, and then writes them; a drain (shutting down)
    writes them at once instead, and the reclaim replays them into the new generation. The
    seam: the copy waits for the test's signal after it has copied, as a long copy would."""
    monkeypatch.setattr(generations, "JOURNAL_MAX_ROWS", 20)
    copied, release = threading.Event(), threading.Event()

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            s = service.store
            assert isinstance(s, MilvusStore)
            copy = s._copy_live

            def held_copy(source: str, target: str, now: float) -> int:
                rows = copy(source, target, now)
                copied.set()
                assert release.wait(60)
                return rows

            s._copy_live = held_copy  # type: ignore[method-assign]
            for start in range(0, 1150, 250):  # past a bound of 100: 1,000 rows deleted
                await stub.StoreBatch(store_batch("a", range(start, start + 250), 100), timeout=10)
                await written(stub)
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, copied.wait, 30), "no reclaim began"
            for start in range(0, 60, 10):  # 10 rows a write: the journal is full after 2
                await stub.StoreBatch(store_batch("late", range(start, start + 10)), timeout=10)
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            assert s.stores_wait()
            assert service.counts[CacheCount.WRITES_HELD] == 1
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.pending_writes >= 30, stats  # held back, not written
            late = [
                (await lookup(stub, f"late text {i}", scope=scope("late"))).outcome
                for i in range(60)
            ]
            assert set(late) == {common_pb2.CACHE_OUTCOME_EXACT}  # read from the buffer
            if drained:
                await service.writes.drain(20)
                assert len(service.writes) == 0  # written while the copy is still held
                assert not release.is_set()
            release.set()
            deadline = time.monotonic() + 30
            while not service.counts[CacheCount.RECLAIMS]:
                assert time.monotonic() < deadline, "the reclaim never ended"
                await asyncio.sleep(0.05)
            await written(stub)
            assert s.collection.endswith("_g1")
            assert not s.stores_wait()
            assert s.count("late") == 60  # every held store written, to the new generation

    asyncio.run(body())
