"""cache/peer_sync.py: when a replica's memory may answer, and which of its writes a peer's
delete could have missed; and the watch streams' heartbeat. No Milvus here
(tests/mesh/test_cache_peer_races.py runs it between real replicas)."""

from __future__ import annotations

import asyncio
import time

import pytest

from hopline.cache import watch_feed
from hopline.cache.peer_sync import LANDED_MAX, PeerSync, guard_memory
from hopline.cache.store import ScopeFilter
from hopline.cache.watch_feed import WatchFeed

ACME = ("acme", "m", "1", "")
GLOBEX = ("globex", "m", "1", "")


def sync() -> PeerSync:
    return PeerSync(stale_s=3.0, margin_s=15.0, history_s=595.0)


def test_memory_answers_only_while_the_log_was_read_recently() -> None:
    s = sync()
    now = time.monotonic()
    assert s.current(now)
    assert not s.current(now + 3.5)
    assert s.read(now + 3.4) >= 3.4  # the gap it had gone unread
    assert s.current(now + 3.5)
    assert not s.outlived_history(594.0)
    assert s.outlived_history(595.0)


def test_a_write_is_kept_until_a_poll_that_began_a_margin_after_it() -> None:
    s = sync()
    s.landed([("k1", ACME)])
    landed = time.monotonic()
    s.read(landed + 14.0)  # a peer's delete before k1 could still be unread
    assert s.matching(["k1"], None) == ["k1"]
    s.read(landed + 15.1)
    assert s.matching(["k1"], None) == []
    assert len(s) == 0


def test_an_event_names_writes_by_id_or_by_scope_once_each() -> None:
    s = sync()
    s.landed([("k1", ACME), ("k2", GLOBEX), ("k3", ACME)])
    assert s.matching(["k2", "unknown"], None) == ["k2"]
    assert s.matching(["k1"], ScopeFilter("acme")) == ["k1", "k3"]
    assert s.matching([], ScopeFilter(model="m", model_version="1")) == ["k1", "k2", "k3"]


def test_the_record_is_bounded_oldest_first() -> None:
    s = sync()
    s.landed((f"k{i}", ACME) for i in range(LANDED_MAX + 5))
    assert len(s) == LANDED_MAX
    assert s.matching(["k0", f"k{LANDED_MAX + 4}"], None) == [f"k{LANDED_MAX + 4}"]


def ended_watches(s: PeerSync) -> bool:
    return s.watches_ended  # read through a call: mypy keeps an attribute narrowed otherwise


def test_an_unread_log_ends_every_watch_once() -> None:
    """Gateways' local tiers serve only while their watch stream is open: past stale_s the
    streams end (once per outage), so no copy outlives what this replica cannot hear."""

    async def go() -> None:
        s = PeerSync(stale_s=0.05, margin_s=1.0, history_s=595.0)
        feed = WatchFeed()
        stream = feed.stream(None)
        assert (await anext(stream)).live
        guard = asyncio.create_task(guard_memory(s, feed, every_s=0.01))
        try:
            ended = [e async for e in stream]
            assert ended == []
            assert ended_watches(s)
            s.read(time.monotonic())
            assert not ended_watches(s)
            assert s.current()
        finally:
            guard.cancel()

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_quiet_stream_says_it_is_alive_as_its_first_message_promises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cache/watch_feed.py: the first message promises a message every heartbeat_ms, and an
    empty one comes when nothing happened (what lets a gateway tell a lost stream from a
    quiet one, gateway/exact_tier.py); events still come as they happen."""
    monkeypatch.setattr(watch_feed, "HEARTBEAT_S", 0.02)

    async def go() -> None:
        feed = WatchFeed()
        # A watcher that did not ask (a gateway of an earlier release, which took any message
        # for an invalidation) hears of none.
        quiet = feed.stream(None)
        assert (await anext(quiet)).heartbeat_ms == 0
        stream = feed.stream(None, heartbeats=True)
        first = await anext(stream)
        assert first.live
        assert first.heartbeat_ms == 20
        assert await asyncio.wait_for(anext(stream), 5) == watch_feed.Event()
        event = watch_feed.Event(entry_ids=["k1"])
        feed.publish(event)
        assert await asyncio.wait_for(anext(stream), 5) == event
        assert await asyncio.wait_for(anext(quiet), 5) == event  # the event, no heartbeat

    asyncio.run(go())
