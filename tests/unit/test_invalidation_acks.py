"""An Invalidate is answered only once every gateway watching has dropped its copies
(cache/watch_feed.py:WatchFeed.confirmed, gateway/exact_tier.py:Acks).

Found by a coherence probe (two gateway workers and a second gateway on one cache): the
cache answered Invalidate as soon as its event was queued for the watch streams, and a
worker's local exact tier answered the invalidated entry EXACT 1-3 ms after the call had
returned, in 4 of 6 rounds. Here the gateway's tier follows the real watch feed in the same
event loop, confirming through `WatchFeed.ack` as the AckInvalidations RPC does; the store
and the pending writes are stand-ins (test_invalidation.py tests the order of the steps).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterable, Callable, Sequence
from typing import Any

import pytest

from hopline.cache import invalidation, watch_feed
from hopline.cache.exact_index import ExactIndex
from hopline.cache.peer_sync import PeerSync
from hopline.cache.store import Entry, ScopeFilter
from hopline.cache.tombstones import Tombstones
from hopline.cache.watch_feed import WatchFeed
from hopline.cache.writer import LateInvalidation
from hopline.gateway.exact_tier import LocalEntry, LocalExactTier
from hopline.gateway.key_mirror import KeyMirror
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

Event = cache_pb2.WatchInvalidationsResponse
KEY = f"{1:064x}"


class Writes:
    def drop(self, ids: list[str], scope: ScopeFilter | None) -> list[str]:
        return []

    def delete_again(self, keys: list[str]) -> None:
        pass

    def invalidate_later(self, late: LateInvalidation) -> None:
        pass


class Store:
    def delete(self, keys: Sequence[str]) -> int:
        return len(keys)

    def delete_scope(self, scope: ScopeFilter) -> int:
        return 1


@dataclasses.dataclass
class Host:
    index: ExactIndex | None = dataclasses.field(default_factory=lambda: ExactIndex(100))
    writes: Writes = dataclasses.field(default_factory=Writes)
    tombstones: Tombstones = dataclasses.field(default_factory=lambda: Tombstones(10.0))
    feed: WatchFeed = dataclasses.field(default_factory=WatchFeed)
    peers: None = None
    peer_sync: PeerSync | None = None

    def require_store(self) -> Store:
        return Store()

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def held_entry(h: Host) -> None:
    assert h.index is not None
    now = time.time()
    h.index.put(Entry(KEY, ("acme", "m", "1", ""), "text", b"", now, now + 3600))


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.001)


def following(feed: WatchFeed, tier: LocalExactTier) -> asyncio.Task[None]:
    def watch() -> AsyncIterable[Event]:
        return feed.stream(None, heartbeats=True, acks=True)

    async def ack(watch_id: str, sequence: int) -> None:
        await asyncio.sleep(0.005)  # the RPC's way back to the cache
        feed.ack(watch_id, sequence)

    return asyncio.get_running_loop().create_task(tier.follow(watch, KeyMirror(0), ack=ack))


async def stopped(tasks: list[asyncio.Task[None]]) -> None:
    """Cancelled until done: Python 3.11's wait_for drops a cancel that lands as its queue
    read completes, so one cancel can be lost while an event is queued."""
    while not all(task.done() for task in tasks):
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=0.1)


def copy_of(key: str, tier: LocalExactTier) -> None:
    now = time.time()
    prediction = common_pb2.Prediction(label="password_reset")
    tier.put(key, LocalEntry(prediction, ("acme", "m", "1", ""), now, now + 3600), tier.generation)


@pytest.mark.parametrize("by_scope", [False, True])
def test_no_gateway_serves_an_entry_once_its_invalidate_returned(by_scope: bool) -> None:
    async def go() -> None:
        h = Host()
        held_entry(h)
        tiers = [LocalExactTier(100), LocalExactTier(100)]  # two gateway workers
        tasks = [following(h.feed, tier) for tier in tiers]
        try:
            await until(lambda: all(t.live for t in tiers), "the watches are live")
            for tier in tiers:
                copy_of(KEY, tier)
                assert tier.get(KEY, time.time()) is not None
            if by_scope:
                await invalidation.invalidate(h, [], ScopeFilter("acme"))
            else:
                await invalidation.invalidate(h, [KEY], None)
            # Before, the call returned with both events still queued: both tiers answered.
            assert [tier.get(KEY, time.time()) for tier in tiers] == [None, None]
        finally:
            await stopped(tasks)

    asyncio.run(go())


def test_a_watcher_that_does_not_confirm_is_cut_off_and_waited_out() -> None:
    """A gateway that applies nothing (a partition, a stalled loop) cannot hold every
    Invalidate up: it is cut off after the wait, and the answer comes once it has gone
    unheard long enough to have stopped serving (SILENT_S after its last message)."""

    async def go() -> None:
        now = [100.0]
        slept: list[float] = []

        async def sleep(s: float) -> None:
            slept.append(s)

        feed = WatchFeed(clock=lambda: now[0], sleep=sleep)
        deaf = feed.stream(None, heartbeats=True, acks=True)
        first = await anext(deaf)  # its last message: at 100
        assert first.live
        assert first.watch_id
        plain = feed.stream(None, heartbeats=True)  # an earlier release's gateway: not waited for
        assert not (await anext(plain)).watch_id
        now[0] = 101.0
        sequence = feed.publish(Event(entry_ids=["k"]), awaited=True)
        assert await feed.confirmed(sequence, wait_s=0.05) == 1
        assert slept == [watch_feed.SILENT_S - 1.0]
        with pytest.raises(StopAsyncIteration):  # cut off: its tier stops serving
            await anext(deaf)
        event = await anext(plain)
        assert list(event.entry_ids) == ["k"]
        assert event.sequence == 0
        # One that confirms is waited for no longer than its confirmation takes.
        prompt = feed.stream(None, heartbeats=True, acks=True)
        watch_id = (await anext(prompt)).watch_id
        sequence = feed.publish(Event(entry_ids=["k2"]), awaited=True)
        feed.ack(watch_id, (await anext(prompt)).sequence)
        assert await feed.confirmed(sequence, wait_s=30) == 0
        assert slept == [watch_feed.SILENT_S - 1.0]

    asyncio.run(go())


def test_a_confirmation_from_a_stream_of_the_cache_before_a_restart_confirms_nothing() -> None:
    """Ids numbered from 1 in each run: a confirmation still on its way from a gateway's stream
    of the run before a restart named the new run's first watcher and confirmed its events
    before it had applied them (a reviewer's read)."""

    async def go() -> None:
        async def sleep(s: float) -> None:
            pass

        before = WatchFeed(sleep=sleep)
        old_id = (await anext(before.stream(None, heartbeats=True, acks=True))).watch_id
        for _ in range(5):
            before.publish(Event(entry_ids=["k"]), awaited=True)
        after = WatchFeed(sleep=sleep)  # the restarted cache
        watcher = after.stream(None, heartbeats=True, acks=True)
        assert (await anext(watcher)).watch_id != old_id
        sequence = after.publish(Event(entry_ids=["k"]), awaited=True)
        after.ack(old_id, 5)
        assert await after.confirmed(sequence, wait_s=0.05) == 1  # still waited for: cut off

    asyncio.run(go())


def test_an_event_nothing_waits_for_is_not_numbered_for_confirmation() -> None:
    """An eviction (one a write batch while the cache is full) goes out unnumbered: only an
    Invalidate waits for confirmations, and numbering every event made each gateway confirm
    each eviction batch too (a reviewer's read)."""

    async def go() -> None:
        feed = WatchFeed()
        watcher = feed.stream(None, heartbeats=True, acks=True)
        assert (await anext(watcher)).watch_id
        assert feed.publish(Event(entry_ids=["evicted"])) == 0
        assert (await anext(watcher)).sequence == 0
        assert feed.publish(Event(entry_ids=["k"]), awaited=True) == 1
        assert (await anext(watcher)).sequence == 1

    asyncio.run(go())
