"""The key mirror on both ends: the cache's watch feed (listing, held keys, order) and the
gateway's mirror of it (what it vouches for, and when it stops vouching). In-process; the
real cache and gateway are in tests/mesh/test_key_mirror_mesh.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hopline.cache.keys import exact_key
from hopline.cache.watch_feed import LISTING_CHUNK, WatchFeed
from hopline.gateway.key_mirror import PURGE_CHUNK, KeyMirror
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

Event = cache_pb2.WatchInvalidationsResponse
T1 = ("t1", "m", "1", "{}")
T2 = ("t2", "m", "1", "{}")


def key(text: str, scope: tuple[str, str, str, str] = T1) -> str:
    return exact_key(scope, text)


def scope_of(scope: tuple[str, str, str, str]) -> common_pb2.Scope:
    return common_pb2.Scope(tenant=scope[0], model=scope[1], model_version=scope[2])


def synced_mirror(*texts: str, scope: tuple[str, str, str, str] = T1) -> KeyMirror:
    mirror = KeyMirror(capacity=100)
    held = cache_pb2.HeldKeys(scope=scope_of(scope), entry_ids=[key(t, scope) for t in texts])
    mirror.apply(Event(held=[held]))
    mirror.apply(Event(keys_synced=True))
    return mirror


def test_the_mirror_vouches_for_a_miss_only_after_the_listing_ends() -> None:
    mirror = KeyMirror(capacity=100)
    held = cache_pb2.HeldKeys(scope=scope_of(T1), entry_ids=[key("a")])
    mirror.apply(Event(held=[held]))
    assert not mirror.known_miss(key("b"))  # listing not over: anything may be held
    mirror.apply(Event(keys_synced=True))
    assert mirror.known_miss(key("b"))
    assert not mirror.known_miss(key("a"))
    mirror.reset()  # the stream broke
    assert not mirror.known_miss(key("b"))
    assert len(mirror) == 0


def test_drops_by_id_and_by_scope_make_keys_misses_again() -> None:
    mirror = synced_mirror("a", "b")
    other = cache_pb2.HeldKeys(scope=scope_of(T2), entry_ids=[key("a", T2)])
    mirror.apply(Event(held=[other]))
    mirror.apply(Event(entry_ids=[key("a")]))
    assert mirror.known_miss(key("a"))
    assert not mirror.known_miss(key("b"))
    # An invalidation naming tenant t1 (model and version left empty: any).
    mirror.apply(Event(scope=common_pb2.Scope(tenant="t1")))
    assert mirror.known_miss(key("b"))
    assert not mirror.known_miss(key("a", T2))  # another tenant's key stays


def test_past_capacity_the_mirror_stops_vouching_until_it_is_reset() -> None:
    mirror = KeyMirror(capacity=3)
    held = cache_pb2.HeldKeys(scope=scope_of(T1), entry_ids=[key(str(i)) for i in range(4)])
    mirror.apply(Event(held=[held]))
    mirror.apply(Event(keys_synced=True))
    assert mirror.full
    assert len(mirror) == 0
    assert not mirror.known_miss(key("never stored"))  # looked up, as without a mirror
    mirror.hold(scope_of(T1), [key("x")])
    assert len(mirror) == 0
    mirror.reset()
    assert not mirror.full


def test_a_scope_invalidation_answers_at_once_and_deletes_its_keys_between_turns_of_the_loop() -> (
    None
):
    """A scope's keys are misses the moment its invalidation is applied; their entries are
    deleted afterwards a chunk at a time, the loop's other work running in between (deleting
    them on the spot held the gateway's loop 531-544 ms at the default capacity of 2 million
    keys: bench/scripts/key_mirror_stall.py). A key stored again meanwhile stays held."""
    n = 3 * PURGE_CHUNK

    async def scenario() -> None:
        mirror = KeyMirror(capacity=n + 10)
        held = cache_pb2.HeldKeys(scope=scope_of(T1), entry_ids=[key(str(i)) for i in range(n)])
        other = cache_pb2.HeldKeys(scope=scope_of(T2), entry_ids=[key("x", T2)])
        mirror.apply(Event(held=[held, other], keys_synced=True))
        turns = 0

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        mirror.apply(Event(scope=common_pb2.Scope(tenant="t1")))
        assert mirror.known_miss(key("0"))
        assert mirror.known_miss(key(str(n - 1)))
        assert len(mirror) == n + 1, "the scope's keys were deleted on the spot"
        mirror.hold(scope_of(T1), [key("7")])  # stored again after the invalidation
        before = turns
        for _ in range(1000):  # turns of the loop, far more than the deletion needs
            if len(mirror) == 2:
                break
            await asyncio.sleep(0)
        assert len(mirror) == 2, "the invalidated scope's keys were never deleted"
        assert turns - before >= 3, "the deletion did not yield to the loop between chunks"
        assert not mirror.known_miss(key("7"))
        assert not mirror.known_miss(key("x", T2))
        assert mirror.known_miss(key("1"))
        ticking.cancel()

    asyncio.run(scenario())


async def take(stream: AsyncIterator[Event], n: int) -> list[Event]:
    return [await anext(stream) for _ in range(n)]


def test_the_listing_comes_in_chunks_then_synced_then_events_in_order() -> None:
    async def main() -> None:
        feed = WatchFeed()
        listing = [(key(str(i)), T1) for i in range(LISTING_CHUNK + 1)]
        stream = feed.stream(listing)
        live, first, second, synced = await take(stream, 4)
        assert live.live
        assert synced.keys_synced
        assert [len(g.entry_ids) for e in (first, second) for g in e.held] == [LISTING_CHUNK, 1]
        assert first.held[0].scope.tenant == "t1"
        # A store, then an invalidation: the held key goes out first, at the invalidation.
        feed.held(key("new", T2), T2)
        feed.publish(Event(entry_ids=[key("0")]))
        held, dropped = await take(stream, 2)
        assert [list(g.entry_ids) for g in held.held] == [[key("new", T2)]]
        assert held.held[0].scope.tenant == "t2"
        assert list(dropped.entry_ids) == [key("0")]
        feed.end_all()
        assert [e async for e in stream] == []

    asyncio.run(main())


def test_held_keys_gather_and_reach_only_watchers_that_asked() -> None:
    async def main() -> None:
        feed = WatchFeed()
        plain, keyed = feed.stream(None), feed.stream([])
        assert (await anext(plain)).live
        assert [e.live or e.keys_synced for e in await take(keyed, 2)] == [True, True]
        feed.held(key("a"), T1)
        feed.held(key("b"), T1)
        feed.let_go([key("c")])  # sends the gathered keys first
        gathered, let_go = await take(keyed, 2)
        assert [list(g.entry_ids) for g in gathered.held] == [[key("a"), key("b")]]
        assert list(let_go.entry_ids) == [key("c")]
        feed.held(key("d"), T1)  # goes out on its own after HELD_FLUSH_S
        later = await asyncio.wait_for(anext(keyed), timeout=2)
        assert [list(g.entry_ids) for g in later.held] == [[key("d")]]
        feed.publish(Event(entry_ids=[key("a")]))  # invalidations reach everyone
        assert list((await anext(plain)).entry_ids) == [key("a")]
        assert list((await anext(keyed)).entry_ids) == [key("a")]
        feed.end_all()

    asyncio.run(main())


def test_a_watcher_that_falls_behind_is_ended_not_skipped() -> None:
    async def main() -> None:
        feed = WatchFeed(queue_size=2)
        stream = feed.stream([])
        await take(stream, 2)  # live, synced
        for i in range(3):
            feed.publish(Event(entry_ids=[key(str(i))]))
        assert [e async for e in stream] == []  # ended: its mirror is reset, never wrong

    asyncio.run(main())
