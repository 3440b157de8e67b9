"""WatchInvalidations' streams: what every watcher hears, and the key listing some ask for.

Every watcher hears invalidations and evictions (by id or by scope), so a copy of exact
entries (the gateway's local exact tier) never outlives them. A watcher that asks for `keys`
also gets the exact keys the cache holds: the listing when its stream opens, then each key
a store adds and each key the exact index lets go of. With that, a gateway can tell an
exact-only miss without a Lookup (gateway/key_mirror.py).

Why the listing and the events agree: a watcher is registered, and the listing's keys are
copied, in one step of the event loop; every change after that step is queued on the stream
behind the listing. Applying the listing and then the queue in order gives the cache's keys.

A stream that asked for heartbeats and has been quiet for `HEARTBEAT_S` sends an empty
message, which the first message promises (`heartbeat_ms`; asked for, since a gateway of an
earlier release took every message for an invalidation and let go of copies in flight): a
watcher that hears nothing for a few periods takes the stream for lost, where a silent
network partition was found by keepalive alone, 15 s later (a probe: the local exact tier
served an invalidated answer 14 s after the Invalidate).

Held keys are gathered for `HELD_FLUSH_S` and sent as one message (a message per store
would cost each side a stream message per miss). Any other event sends them first, so the
stream keeps the order in which things happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

Event = cache_pb2.WatchInvalidationsResponse
Scope = tuple[str, str, str, str]  # tenant, model, version, parameters (Entry.scope)
Held = list[tuple[str, Scope]]  # (exact key, its scope)

WATCH_QUEUE = 1024  # events a watcher may fall behind before its stream ends
LISTING_CHUNK = 4096  # keys per listing message: about 280 KB, well under gRPC's 4 MiB
HELD_FLUSH_S = 0.02  # how long new keys gather before they go out
# A stream that has said nothing this long says so with an empty message: the watcher tells
# a quiet cache from a lost one (gateway/exact_tier.py, HEARTBEATS_MISSED of these).
HEARTBEAT_S = 1.0


@dataclasses.dataclass(eq=False)
class _Watcher:
    queue: asyncio.Queue[Event | None]
    keys: bool


class WatchFeed:
    def __init__(self, queue_size: int = WATCH_QUEUE) -> None:
        self.queue_size = queue_size
        self._watchers: set[_Watcher] = set()
        self.key_watchers = 0  # of them, those that asked for keys (read on every store)
        self._held: dict[Scope, list[str]] = {}  # stored since the last flush
        self._flush: asyncio.TimerHandle | None = None

    async def stream(self, listing: Held | None, heartbeats: bool = False) -> AsyncIterator[Event]:
        """One watcher's messages: `live`, the listing when given (None: the watcher gets
        no keys), then every event, until the feed ends it; with `heartbeats`, an empty one
        after HEARTBEAT_S of quiet. The caller copies the listing in the loop step that
        starts this stream (no await between the two)."""
        watcher = _Watcher(asyncio.Queue(self.queue_size), keys=listing is not None)
        self._flush_held()  # stores before this point are in the listing, not in its queue
        self._add(watcher)
        keys = listing
        try:
            beat_s = HEARTBEAT_S if heartbeats else None
            yield Event(live=True, heartbeat_ms=round(HEARTBEAT_S * 1e3) if heartbeats else 0)
            if keys is not None:
                for start in range(0, len(keys), LISTING_CHUNK):
                    yield Event(held=_groups(keys[start : start + LISTING_CHUNK]))
                yield Event(keys_synced=True)
            while True:
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), beat_s)
                except TimeoutError:
                    yield Event()  # nothing happened: said, so silence means a lost stream
                    continue
                if event is None:
                    break
                yield event
        finally:
            self._discard(watcher)

    def publish(self, event: Event) -> None:
        """An invalidation or eviction, to every watcher."""
        self._flush_held()
        self._send(event, key_watchers_only=False)

    def let_go(self, keys: list[str]) -> None:
        """Keys the exact index dropped (expired, or out of room): only key listings care, a
        copy of an entry keeps its own expiry."""
        if keys and self.key_watchers:
            self._flush_held()
            self._send(Event(entry_ids=keys), key_watchers_only=True)

    def held(self, key: str, scope: Scope) -> None:
        """A store the cache accepted: its key goes out with the next flush."""
        if not self.key_watchers:
            return
        self._held.setdefault(scope, []).append(key)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(HELD_FLUSH_S, self._flush_held)

    def end_all(self) -> None:
        """End every stream (a drain): watchers drop what they copied and reconnect."""
        for watcher in list(self._watchers):
            self._end(watcher)

    def _flush_held(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._held:
            held, self._held = self._held, {}
            event = Event(held=[_group(scope, keys) for scope, keys in held.items()])
            self._send(event, key_watchers_only=True)

    def _send(self, event: Event, *, key_watchers_only: bool) -> None:
        for watcher in list(self._watchers):
            if key_watchers_only and not watcher.keys:
                continue
            try:
                watcher.queue.put_nowait(event)
            except asyncio.QueueFull:
                # A watcher this far behind ends its stream; it drops its copy and starts over,
                # which is always safe, where a lost event would not be.
                self._end(watcher)

    def _add(self, watcher: _Watcher) -> None:
        self._watchers.add(watcher)
        self.key_watchers += watcher.keys

    def _discard(self, watcher: _Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.discard(watcher)
            self.key_watchers -= watcher.keys

    def _end(self, watcher: _Watcher) -> None:
        self._discard(watcher)
        while not watcher.queue.empty():
            watcher.queue.get_nowait()
        watcher.queue.put_nowait(None)


def _groups(keys: list[tuple[str, Scope]]) -> list[cache_pb2.HeldKeys]:
    by_scope: dict[Scope, list[str]] = {}
    for key, scope in keys:
        by_scope.setdefault(scope, []).append(key)
    return [_group(scope, ids) for scope, ids in by_scope.items()]


def _group(scope: Scope, keys: list[str]) -> cache_pb2.HeldKeys:
    # Parameters are left out: scope invalidations match on tenant, model and version only.
    tenant, model, version, _ = scope
    return cache_pb2.HeldKeys(
        scope=common_pb2.Scope(tenant=tenant, model=model, model_version=version),
        entry_ids=keys,
    )
