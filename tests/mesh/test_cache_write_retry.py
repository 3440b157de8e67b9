"""A batched write Milvus fails is written again, not dropped: the real CacheService (real
milvus-lite file, real gRPC server, in this process so its store and index can be looked at).

Stand-ins: `MilvusStore.upsert` is wrapped so that its first call writes the rows and then
raises, as a write whose client timed out after Milvus had applied it, or so that it fails
every write carrying one chosen row (a real milvus-lite cannot be made to time out or refuse
one chosen call while it keeps serving the others)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from cache_service import cache, lookup, run, scope, store, written

from hopline.cache import milvus_lite
from hopline.cache import writer as writer_module
from hopline.cache.counts import CacheCount
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.service import CacheService
from hopline.cache.store import CacheStoreError, Entry
from hopline.cache.writer import MAX_WRITE_ATTEMPTS, WRITE_ROWS
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

EXACT = common_pb2.CACHE_OUTCOME_EXACT


def first_write_lands_then_fails(
    service: CacheService, before_landing: Callable[[], None] = lambda: None
) -> list[list[str]]:
    """The store's first upsert runs `before_landing`, writes its rows and raises; later ones
    write. Returns the keys of every upsert, in order."""
    assert isinstance(service.store, MilvusStore)
    real = service.store.upsert
    calls: list[list[str]] = []

    def upsert(rows: Sequence[tuple[Entry, Any]]) -> None:
        calls.append([entry.key for entry, _ in rows])
        if len(calls) > 1:
            real(rows)
            return
        before_landing()
        real(rows)
        raise CacheStoreError("Milvus at test: timed out after the write landed (test)")

    service.store.upsert = upsert  # type: ignore[method-assign]
    return calls


class InvalidatedInFlight:
    """The store's first upsert waits in its thread until `invalidate` has deleted an entry it
    carries, then writes its rows and raises (`first_write_lands_then_fails`): the write
    lands after the invalidation's delete, then reports a failure."""

    def __init__(self, service: CacheService) -> None:
        self._writing, self._invalidated = threading.Event(), threading.Event()
        first_write_lands_then_fails(service, self._hold)

    def _hold(self) -> None:
        self._writing.set()
        self._invalidated.wait(10)

    async def invalidate(self, stub: Any, key: str) -> None:
        assert await asyncio.to_thread(self._writing.wait, 10)  # the write waits in its thread
        await stub.Invalidate(cache_pb2.InvalidateRequest(entry_ids=[key]), timeout=10)
        self._invalidated.set()


def fail_every_write_of(service: CacheService, text: str, *, lands: bool) -> None:
    """Every upsert carrying `text`'s row raises; with `lands`, after writing its rows (a
    write whose client timed out after Milvus applied it)."""
    assert isinstance(service.store, MilvusStore)
    real = service.store.upsert

    def upsert(rows: Sequence[tuple[Entry, Any]]) -> None:
        carries = any(entry.text == text for entry, _ in rows)
        if carries and not lands:
            raise CacheStoreError("Milvus at test: refuses this row (test)")
        real(rows)
        if carries:
            raise CacheStoreError("Milvus at test: timed out after the write landed (test)")

    service.store.upsert = upsert  # type: ignore[method-assign]


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "WRITE_RETRY_MIN_S", 0.02)
    monkeypatch.setattr(writer_module, "WRITE_RETRY_MAX_S", 0.05)


async def milvus_count(service: CacheService, tenant: str) -> int:
    assert service.store is not None
    return await asyncio.to_thread(service.store.count, tenant, "m")


def test_a_write_milvus_failed_is_written_again_and_indexed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            calls = first_write_lands_then_fails(service)
            retry = scope(tenant="retry")
            keys = [await store(stub, f"retried {i}", scope=retry) for i in range(3)]
            await written(stub)
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert (stats.write_retries, stats.store_errors) == (1, 0)
            # The failed write's rows were in a later write again.
            assert set(calls[0]) <= {key for call in calls[1:] for key in call}
            # Written again and indexed: exact hits from memory, each entry once in Milvus.
            assert service.index is not None
            assert all(key in service.index for key in keys)
            for i in range(3):
                hit = await lookup(stub, f"retried {i}", scope=retry)
                assert hit.outcome == EXACT
            assert await milvus_count(service, "retry") == 3

    with caplog.at_level(logging.INFO, logger="hopline.cache"):
        run(body)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("hopline.cache")]
    # The failure is said, and so is the end of it (nothing said that writes landed again).
    assert said.count("cache write failed; retrying") == 1
    assert said.count("cache writes succeed again") == 1


def test_an_entry_invalidated_during_a_failed_write_is_deleted_again(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            in_flight = InvalidatedInFlight(service)
            doomed = await store(stub, "invalidated in flight", scope=scope(tenant="gone"))
            kept = await store(stub, "kept in flight", scope=scope(tenant="gone"))
            await in_flight.invalidate(stub, doomed)
            await written(stub)
            deadline = time.monotonic() + 10
            while (count := await milvus_count(service, "gone")) != 1:
                assert time.monotonic() < deadline, f"{count} entries in Milvus: resurrected"
                await asyncio.sleep(0.05)
            assert service.index is not None
            assert doomed not in service.index
            assert kept in service.index
            missed = await lookup(stub, "invalidated in flight", scope=scope(tenant="gone"))
            assert missed.outcome != EXACT

    run(body)


def test_a_backlog_is_written_in_bounded_writes(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db", flush_interval_ms=50.0) as (service, stub):
            assert isinstance(service.store, MilvusStore)
            real = service.store.upsert
            sizes: list[int] = []

            def upsert(rows: Sequence[tuple[Entry, Any]]) -> None:
                sizes.append(len(rows))
                real(rows)

            service.store.upsert = upsert  # type: ignore[method-assign]
            requests = [
                cache_pb2.StoreRequest(
                    scope=scope(tenant="backlog"),
                    text=f"backlog {i}",
                    prediction=common_pb2.Prediction(label="order_status"),
                    mode="exact",
                )
                for i in range(WRITE_ROWS + 300)
            ]
            # Two calls inside one flush interval: one backlog over WRITE_ROWS.
            for part in (requests[:WRITE_ROWS], requests[WRITE_ROWS:]):
                await stub.StoreBatch(cache_pb2.StoreBatchRequest(stores=part), timeout=30)
            await written(stub)
            assert sum(sizes) == WRITE_ROWS + 300
            assert max(sizes) == WRITE_ROWS
            assert await milvus_count(service, "backlog") == WRITE_ROWS + 300

    run(body)


@pytest.mark.usefixtures("quick_retries")
class MilvusDown:
    """Milvus answering nothing while `down`: every write and every read of a key fails, as
    with the server stopped (the cache's own process keeps serving)."""

    def __init__(self, service: CacheService) -> None:
        assert isinstance(service.store, MilvusStore)
        self.down = True
        real_upsert, real_get = service.store.upsert, service.store.get

        def upsert(rows: Sequence[tuple[Entry, Any]]) -> None:
            if self.down:
                raise CacheStoreError("Milvus at test: connection refused (test)")
            real_upsert(rows)

        def get(key: str, now: float) -> Entry | None:
            if self.down:
                raise CacheStoreError("Milvus at test: connection refused (test)")
            return real_get(key, now)

        def count(tenant: str = "", model: str = "") -> int:
            if self.down:
                raise CacheStoreError("Milvus at test: connection refused (test)")
            return real_count(tenant, model)

        real_count = service.store.count
        service.store.upsert = upsert  # type: ignore[method-assign]
        service.store.get = get  # type: ignore[method-assign]
        service.store.count = count  # type: ignore[method-assign]


@pytest.mark.usefixtures("quick_retries")
def test_a_store_waits_out_a_milvus_that_answers_nothing(tmp_path: Path) -> None:
    """An acknowledged store was dropped after five failed writes, about 20 s into an outage
    (found stopping a Milvus server under traffic); docs/cache.md promised it stays pending
    until it lands. And GetStats answers meanwhile, saying Milvus does not."""

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            milvus = MilvusDown(service)
            outage = scope(tenant="outage")
            await store(stub, "held through the outage", scope=outage)
            await until(
                lambda: service.counts[CacheCount.WRITE_RETRIES] > 2 * MAX_WRITE_ATTEMPTS,
                "the writes never failed",
            )
            # The outage's figures are answered (GetStats was UNAVAILABLE throughout).
            during = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert during.milvus_unreachable
            assert during.pending_writes == 1
            assert during.write_retries > 2 * MAX_WRITE_ATTEMPTS
            milvus.down = False
            await written(stub)
            assert not (await stub.GetStats(cache_pb2.GetStatsRequest())).milvus_unreachable
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.store_errors == 0
            assert (await lookup(stub, "held through the outage", scope=outage)).outcome == EXACT
            assert await milvus_count(service, "outage") == 1

    run(body)


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize(
    "shortage",
    [
        " (the disk holding x has 168 KiB free: probably full; free space there ...)",
        ": [Errno 24] Too many open files",
    ],
)
def test_a_store_waits_out_a_shortage_of_the_hosts_own(tmp_path: Path, shortage: str) -> None:
    """A disk nearly full or no file descriptor left fails every write while Milvus still
    answers reads: acknowledged stores were dropped after five writes, 25 s in (a
    resource-exhaustion probe). They wait, and are written once the shortage is over."""

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            assert isinstance(service.store, MilvusStore)
            real = service.store.upsert
            short = [True]

            def upsert(rows: Sequence[tuple[Entry, Any]]) -> None:
                if short[0]:
                    raise CacheStoreError(f"Milvus at test: Unexpected error{shortage}")
                real(rows)

            service.store.upsert = upsert  # type: ignore[method-assign]
            await store(stub, "kept through the shortage", scope=scope(tenant="short"))
            await until(
                lambda: service.counts[CacheCount.WRITE_RETRIES] > 2 * MAX_WRITE_ATTEMPTS,
                "the writes never failed",
            )
            short[0] = False
            await written(stub)
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.store_errors == 0
            found = await lookup(stub, "kept through the shortage", scope=scope(tenant="short"))
            assert found.outcome == EXACT
            assert await milvus_count(service, "short") == 1

    run(body)


@pytest.mark.usefixtures("quick_retries")
def test_a_nearly_full_disk_holds_stores_back_until_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """milvus-lite answers most inserts on a full disk as written and keeps none of them (a
    probe: 2,048 of 2,420 acknowledged entries gone after a restart, nothing said). With less
    than LOW_DISK_BYTES free a milvus-lite file is not written to: the stores wait, and are
    written once there is room. The disk's free space is given here, not made."""
    free = [1 << 20]
    real_usage = shutil.disk_usage

    def usage(path: Any) -> Any:
        total, used, _ = real_usage(path)
        return type(real_usage(path))(total, used, free[0])

    monkeypatch.setattr(shutil, "disk_usage", usage)

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            await store(stub, "kept off a full disk", scope=scope(tenant="full"))
            await until(
                lambda: service.counts[CacheCount.WRITE_RETRIES] > 2, "nothing held the write"
            )
            assert await milvus_count(service, "full") == 0  # not handed to milvus-lite
            free[0] = milvus_lite.LOW_DISK_BYTES * 4
            await written(stub)
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.store_errors == 0
            assert await milvus_count(service, "full") == 1

    run(body)


def test_a_store_milvus_keeps_refusing_is_dropped_and_holds_nothing_back(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            fail_every_write_of(service, "refused every time", lands=False)
            poison = scope(tenant="poison")
            await store(stub, "refused every time", scope=poison)
            await until(
                lambda: bool(service.counts[CacheCount.WRITE_RETRIES]), "the write never failed"
            )
            # Stored behind it: written once the refused store is given up.
            await store(stub, "written after", scope=poison)
            await written(stub)
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.store_errors == 1
            assert stats.write_retries >= MAX_WRITE_ATTEMPTS
            assert (await lookup(stub, "written after", scope=poison)).outcome == EXACT
            assert (await lookup(stub, "refused every time", scope=poison)).outcome != EXACT
            assert await milvus_count(service, "poison") == 1

    run(body)


@pytest.mark.usefixtures("quick_retries")
def test_a_store_given_up_after_writes_that_landed_is_not_left_in_milvus(tmp_path: Path) -> None:
    # Each write of the row lands and then reports a failure (timed out, say): once the store
    # is given up, Milvus must not keep a row the index does not have.
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            fail_every_write_of(service, "lands and times out", lands=True)
            landed = scope(tenant="landed")
            key = await store(stub, "lands and times out", scope=landed)
            await until(lambda: bool(service.counts[CacheCount.STORE_ERRORS]), "never given up")
            await written(stub)
            assert service.index is not None
            assert key not in service.index
            assert await milvus_count(service, "landed") == 0

    run(body)


FENCE_S = 0.3


def test_a_key_stored_again_after_a_failed_re_delete_stays_in_milvus(tmp_path: Path) -> None:
    # An entry invalidated while its write was in flight is deleted again after the write; when
    # that delete fails it waits for the next write. A new store of the same key meanwhile
    # replaces the row: deleting it after that write would lose the new store from Milvus
    # while the index holds it.
    async def body() -> None:
        # Tombstones kept briefly: a store within their time is fenced (cache/tombstones.py),
        # and the new store here is one made after it.
        async with cache(tmp_path / "cache.db", tombstone_s=FENCE_S) as (service, stub):
            in_flight = InvalidatedInFlight(service)
            assert isinstance(service.store, MilvusStore)
            real_delete = service.store.delete
            deletes: list[list[str]] = []

            def delete(keys: Sequence[str]) -> int:
                deletes.append(list(keys))
                if len(deletes) == 2:  # the first re-delete (the first is Invalidate's)
                    raise CacheStoreError("Milvus at test: delete failed (test)")
                return real_delete(keys)

            service.store.delete = delete  # type: ignore[method-assign]
            again = scope(tenant="again")
            key = await store(stub, "invalidated then stored again", scope=again)
            await in_flight.invalidate(stub, key)
            await until(lambda: len(deletes) >= 2, "no re-delete was tried")
            await asyncio.sleep(FENCE_S + 0.1)
            assert await store(stub, "invalidated then stored again", scope=again) == key
            await written(stub)
            assert service.index is not None
            assert key in service.index
            hit = await lookup(stub, "invalidated then stored again", scope=again)
            assert hit.outcome == EXACT
            assert await milvus_count(service, "again") == 1

    run(body)
