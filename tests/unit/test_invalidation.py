"""cache/invalidation.py: the order an invalidation takes out of memory, Milvus and the other
replicas, and what a failure at each step leaves.

Stand-ins: the store and the replicas' log (`peers`) record calls and fail on demand, and the
pending writes record what they were told to drop: a Milvus server that fails one chosen call
cannot be made here (tests/mesh/test_cache.py and test_cache_shared_milvus.py run the same
code against milvus-lite and its server). The exact index, tombstones and watch feed are the
real ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from hopline.cache import invalidation
from hopline.cache.exact_index import ExactIndex
from hopline.cache.peer_sync import PeerSync
from hopline.cache.store import CacheStoreError, Entry, ScopeFilter
from hopline.cache.tombstones import Tombstones
from hopline.cache.watch_feed import WatchFeed
from hopline.cache.writer import LateInvalidation
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

Event = cache_pb2.WatchInvalidationsResponse


def entry(n: int, tenant: str = "acme") -> Entry:
    return Entry(
        key=f"{n:064x}",
        scope=(tenant, "m", "1", ""),
        text=f"text {n}",
        response=b"",
        created_at=time.time(),
        expires_at=time.time() + 3600,
    )


@dataclasses.dataclass
class Journal:
    steps: list[str] = dataclasses.field(default_factory=list)


class Writes:
    def __init__(self, journal: Journal, pending: list[Entry] | None = None) -> None:
        self.journal = journal
        self.pending = list(pending or [])
        self.late: list[LateInvalidation] = []

    def drop(self, ids: list[str], scope: ScopeFilter | None) -> list[str]:
        self.journal.steps.append(f"writes.drop {len(ids)} {scope is not None}")
        dropped = [
            e.key for e in self.pending if e.key in ids or (scope and scope.matches(e.scope))
        ]
        self.pending = [e for e in self.pending if e.key not in dropped]
        return dropped

    def delete_again(self, keys: list[str]) -> None:
        if keys:
            self.journal.steps.append(f"writes.delete_again {sorted(keys)}")

    def invalidate_later(self, late: LateInvalidation) -> None:
        self.late.append(late)


class Store:
    def __init__(self, journal: Journal, fail: bool = False) -> None:
        self.journal, self.fail = journal, fail

    def delete(self, keys: list[str]) -> int:
        self.journal.steps.append(f"store.delete {len(keys)}")
        if self.fail:
            raise CacheStoreError("Milvus at /tmp/x.db: connection refused")
        return len(keys)

    def delete_scope(self, scope: ScopeFilter) -> int:
        self.journal.steps.append(f"store.delete_scope {scope.tenant}")
        return 7


class Peers:
    def __init__(self, journal: Journal, fail: bool = False) -> None:
        self.journal, self.fail = journal, fail

    def append(self, event: Event) -> None:
        self.journal.steps.append(f"peers.append {len(event.entry_ids)}")
        if self.fail:
            raise CacheStoreError("Milvus at http://m:19530: deadline exceeded")


@dataclasses.dataclass
class Host:
    journal: Journal
    store: Store
    writes: Writes
    peers: Peers | None
    index: ExactIndex | None = dataclasses.field(default_factory=lambda: ExactIndex(100))
    tombstones: Tombstones = dataclasses.field(default_factory=lambda: Tombstones(10.0))
    feed: WatchFeed = dataclasses.field(default_factory=WatchFeed)
    peer_sync: PeerSync | None = None

    def require_store(self) -> Any:
        return self.store

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def host(*, fail_delete: bool = False, fail_share: bool = False, peers: bool = True) -> Host:
    journal = Journal()
    return Host(
        journal,
        Store(journal, fail_delete),
        Writes(journal),
        Peers(journal, fail_share) if peers else None,
    )


def filled(h: Host, *entries: Entry) -> Host:
    assert h.index is not None
    for e in entries:
        h.index.put(e)
    return h


async def watch(feed: WatchFeed) -> AsyncIterator[Event]:
    stream = feed.stream(None)
    assert (await anext(stream)).live  # the watcher is registered from here
    return stream


def test_entries_leave_memory_before_milvus_and_the_event_follows_the_delete() -> None:
    async def go() -> None:
        a, b = entry(1), entry(2)
        h = filled(host(), a, b)
        stream = await watch(h.feed)
        removed = await invalidation.invalidate(h, [a.key], None)
        assert removed == 1
        assert h.journal.steps == ["writes.drop 1 False", "store.delete 1", "peers.append 1"]
        assert h.index is not None
        assert a.key not in h.index
        assert b.key in h.index
        assert h.tombstones.hides(a, time.monotonic())
        assert not h.tombstones.hides(b, 0.0)
        event = await anext(stream)
        assert list(event.entry_ids) == [a.key]
        assert not event.HasField("scope")

    asyncio.run(go())


def test_a_scope_is_deleted_by_filter_and_named_in_the_event() -> None:
    async def go() -> None:
        mine, theirs = entry(1, "acme"), entry(2, "globex")
        h = filled(host(peers=False), mine, theirs)
        stream = await watch(h.feed)
        removed = await invalidation.invalidate(h, [], ScopeFilter("acme"))
        assert removed == 7  # the store's count, ids and scope together
        assert h.journal.steps == [
            "writes.drop 0 True",
            "store.delete 0",
            "store.delete_scope acme",
        ]
        assert h.index is not None
        assert mine.key not in h.index
        assert theirs.key in h.index
        event = await anext(stream)
        assert event.scope == common_pb2.Scope(tenant="acme")

    asyncio.run(go())


def test_a_failed_delete_is_held_hidden_told_to_the_gateways_and_left_to_the_writer() -> None:
    """The tombstones alone lapsed after keep_s and the gateways kept their copies (a cache
    probe: 60 of 60 entries served again): the entries stay hidden until the writer's retry
    of the delete lands, and the gateways drop theirs at once."""

    async def go() -> None:
        a = entry(1)
        h = filled(host(fail_delete=True), a)
        stream = await watch(h.feed)
        with pytest.raises(invalidation.NotDeleted, match="connection refused"):
            await invalidation.invalidate(h, [a.key], ScopeFilter("acme"))
        assert h.index is not None
        assert a.key not in h.index
        assert h.tombstones.hides(a, time.monotonic() + 3600)  # held, not for keep_s
        assert h.tombstones.fences(a.key, a.scope, time.monotonic() + 3600)
        assert "peers.append 1" not in h.journal.steps  # the replicas: once it lands
        [late] = h.writes.late
        assert (late.ids, late.scope) == ([a.key], ScopeFilter("acme"))
        event = await anext(stream)
        assert list(event.entry_ids) == [a.key]
        assert event.scope.tenant == "acme"
        assert late.event == event

    asyncio.run(go())


def test_a_failed_notice_to_the_replicas_says_the_entries_were_deleted() -> None:
    async def go() -> None:
        a = entry(1)
        h = filled(host(fail_share=True), a)
        with pytest.raises(invalidation.NotShared, match="deleted, but the other cache replicas"):
            await invalidation.invalidate(h, [a.key], None)
        assert h.journal.steps == ["writes.drop 1 False", "store.delete 1", "peers.append 1"]

    asyncio.run(go())


def test_another_replicas_event_is_applied_to_memory_and_passed_on() -> None:
    async def go() -> None:
        mine, theirs = entry(1, "acme"), entry(2, "globex")
        h = filled(host(), mine, theirs)
        stream = await watch(h.feed)
        event = Event(scope=common_pb2.Scope(tenant="globex"), entry_ids=[mine.key])
        invalidation.apply_peer(h, event)
        assert h.index is not None
        assert len(h.index) == 0
        assert h.tombstones.hides(theirs, time.monotonic())
        assert h.journal.steps == ["writes.drop 1 True"]  # no Milvus call, no re-share
        assert await anext(stream) == event

    asyncio.run(go())


def test_what_this_replica_wrote_too_late_for_a_peers_delete_is_deleted_again() -> None:
    """A peer deletes from Milvus, then logs the event; this replica hears it a poll later.
    A store it wrote meanwhile, or still holds pending (a failed write may have landed),
    stayed in Milvus and was served again for its whole TTL once the tombstones expired (a
    probe of two replicas on one Milvus server): such keys are deleted again, and only they."""

    async def go() -> None:
        landed, landed_other, pending, old = (
            entry(1, "acme"),
            entry(2, "globex"),
            entry(3, "acme"),
            entry(4, "acme"),
        )
        h = host()
        h.writes = Writes(h.journal, [pending])
        h.peer_sync = PeerSync(stale_s=3.0, margin_s=15.0, history_s=595.0)
        h.peer_sync.landed([(old.key, old.scope)])
        # A poll that began long after `old` landed: a peer's delete before it was read.
        h.peer_sync.read(time.monotonic() + 20.0)
        h.peer_sync.landed((e.key, e.scope) for e in (landed, landed_other))
        invalidation.apply_peer(h, Event(scope=common_pb2.Scope(tenant="acme")))
        assert h.journal.steps == [
            "writes.drop 0 True",
            f"writes.delete_again {sorted([pending.key, landed.key])}",
        ]
        h.journal.steps.clear()
        invalidation.apply_peer(h, Event(entry_ids=[landed_other.key, "f" * 64]))
        assert h.journal.steps == [
            "writes.drop 2 False",
            f"writes.delete_again {[landed_other.key]}",
        ]

    asyncio.run(go())


def test_everything_in_memory_goes_when_the_peers_log_may_have_lost_events() -> None:
    async def go() -> None:
        a, b, pending = entry(1, "acme"), entry(2, "globex"), entry(3, "initech")
        h = filled(host(), a, b)
        h.writes = Writes(h.journal, [pending])
        stream = await watch(h.feed)
        invalidation.forget_all(h)
        assert h.index is not None
        assert len(h.index) == 0
        now = time.monotonic()
        assert all(h.tombstones.hides(e, now) for e in (a, b, pending))
        assert h.journal.steps == ["writes.drop 0 True", f"writes.delete_again {[pending.key]}"]
        event = await anext(stream)
        assert event.HasField("scope")
        assert event.scope == common_pb2.Scope()  # every scope

    asyncio.run(go())


def test_an_invalidate_cancelled_while_its_delete_waits_is_held_all_the_same() -> None:
    """Only Milvus's error was held: a call cancelled while its delete waited (its caller's
    deadline, queued behind an outage) left the entries to come back after keep_s and the
    gateways' copies in place (a reviewer's read). The delete may or may not have run;
    running it again is harmless."""

    async def go() -> None:
        a = entry(1)
        h = filled(host(), a)

        async def cancelled(fn: Callable[..., Any], *args: Any) -> Any:
            raise asyncio.CancelledError

        h.io_call = cancelled  # type: ignore[method-assign]
        stream = await watch(h.feed)
        with pytest.raises(asyncio.CancelledError):
            await invalidation.invalidate(h, [a.key], None)
        assert h.tombstones.hides(a, time.monotonic() + 3600)
        [late] = h.writes.late
        assert late.ids == [a.key]
        assert list((await anext(stream)).entry_ids) == [a.key]

    asyncio.run(go())
