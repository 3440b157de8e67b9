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

A watcher that asks for `acks` (with heartbeats) confirms each invalidation and eviction
once it has applied it, and an Invalidate is answered only then (`confirmed`): answered as soon
as its event was queued, the call returned while the event was still on its way, and a
gateway's local exact tier answered the invalidated entry 1-3 ms after it (a coherence probe:
4 of 6 rounds, two gateway workers). A watcher that has not confirmed within ACK_WAIT_S is cut
off, and the answer waits until it has gone unheard long enough to have stopped serving
(SILENT_S). Only where this cache is its store's one replica: over a Milvus server the other
replicas' watchers hear of it at their next poll of the shared log, which no ack covers.

Held keys are gathered for `HELD_FLUSH_S` and sent as one message (a message per store
would cost each side a stream message per miss). Any other event sends them first, so the
stream keeps the order in which things happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.cache.watch_feed")

Event = cache_pb2.WatchInvalidationsResponse
Scope = tuple[str, str, str, str]  # tenant, model, version, parameters (Entry.scope)
Held = list[tuple[str, Scope]]  # (exact key, its scope)

WATCH_QUEUE = 1024  # events a watcher may fall behind before its stream ends
LISTING_CHUNK = 4096  # keys per listing message: about 280 KB, well under gRPC's 4 MiB
HELD_FLUSH_S = 0.02  # how long new keys gather before they go out
# A stream that has said nothing this long says so with an empty message: the watcher tells
# a quiet cache from a lost one (gateway/exact_tier.py, HEARTBEATS_MISSED of these).
HEARTBEAT_S = 1.0
# How long an Invalidate waits for its watchers' confirmations before it cuts the late ones
# off; a gateway applies an event and confirms it within milliseconds.
ACK_WAIT_S = 1.0
# How long after its last message a watcher that asked for heartbeats has certainly stopped
# serving its copy: a gateway gives up after three silent periods
# (gateway/exact_tier.py:HEARTBEATS_MISSED), and one more covers the message's way to it.
SILENT_S = 4 * HEARTBEAT_S


@dataclasses.dataclass(eq=False)
class _Watcher:
    queue: asyncio.Queue[tuple[Event, int] | None]  # an event and its sequence (0: none)
    keys: bool
    watch_id: str = ""  # set where it confirms what it applied
    acked: int = 0  # the last sequence it confirmed
    # When its last message was handed to gRPC (each is sent before the generator resumes,
    # so this is the later of the two where it matters).
    last_sent: float = 0.0


class WatchFeed:
    def __init__(
        self,
        queue_size: int = WATCH_QUEUE,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.queue_size = queue_size
        self._clock, self._sleep = clock, sleep
        self._sequence = 0  # of the last awaited invalidation published
        # Unique across this cache's runs too: a confirmation on its way from a stream of the
        # run before a restart names an id no new stream has, rather than confirming for one.
        self._run_id = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._acking: dict[str, _Watcher] = {}  # by watch_id
        self._progress = asyncio.Event()  # set (and replaced) at each confirmation or end
        self._watchers: set[_Watcher] = set()
        self.key_watchers = 0  # of them, those that asked for keys (read on every store)
        self._held: dict[Scope, list[str]] = {}  # stored since the last flush
        self._flush: asyncio.TimerHandle | None = None

    async def stream(
        self, listing: Held | None, heartbeats: bool = False, acks: bool = False
    ) -> AsyncIterator[Event]:
        """One watcher's messages: `live`, the listing when given (None: the watcher gets
        no keys), then every event, until the feed ends it; with `heartbeats`, an empty one
        after HEARTBEAT_S of quiet, and with `acks` too, a `watch_id` and each event's
        `sequence` to confirm (`ack`). The caller copies the listing in the loop step that
        starts this stream (no await between the two)."""
        watcher = _Watcher(asyncio.Queue(self.queue_size), keys=listing is not None)
        if acks and heartbeats:  # SILENT_S bounds only a watcher that hears heartbeats
            watcher.watch_id = f"{self._run_id}-{next(self._ids)}"
            watcher.acked = self._sequence  # nothing before its stream is its to confirm
        self._flush_held()  # stores before this point are in the listing, not in its queue
        self._add(watcher)
        keys = listing
        try:
            beat_s = HEARTBEAT_S if heartbeats else None
            watcher.last_sent = self._clock()
            yield Event(
                live=True,
                heartbeat_ms=round(HEARTBEAT_S * 1e3) if heartbeats else 0,
                watch_id=watcher.watch_id,
            )
            watcher.last_sent = self._clock()
            if keys is not None:
                for start in range(0, len(keys), LISTING_CHUNK):
                    yield Event(held=_groups(keys[start : start + LISTING_CHUNK]))
                    watcher.last_sent = self._clock()
                yield Event(keys_synced=True)
            while True:
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), beat_s)
                except TimeoutError:
                    watcher.last_sent = self._clock()
                    yield Event()  # nothing happened: said, so silence means a lost stream
                    continue
                if item is None:
                    break
                event, sequence = item
                if sequence and watcher.watch_id:
                    stamped = Event()
                    stamped.CopyFrom(event)  # one event object is every watcher's
                    stamped.sequence = sequence
                    event = stamped
                watcher.last_sent = self._clock()
                yield event
        finally:
            self._discard(watcher)

    def publish(self, event: Event, *, awaited: bool = False) -> int:
        """An invalidation or eviction, to every watcher. `awaited` (an Invalidate that waits
        in `confirmed`): numbered for the watchers to confirm, and its sequence returned;
        others go unnumbered (0), so an eviction, a write batch's, costs no confirmation."""
        self._flush_held()
        if awaited:
            self._sequence += 1
        sequence = self._sequence if awaited else 0
        self._send(event, key_watchers_only=False, sequence=sequence)
        return sequence

    def ack(self, watch_id: str, sequence: int) -> None:
        """A watcher has applied its events up to `sequence` (an unknown id: a stream that
        has ended, or one of this cache's previous run; nothing to confirm)."""
        watcher = self._acking.get(watch_id)
        if watcher is None or sequence <= watcher.acked:
            return
        watcher.acked = min(sequence, self._sequence)
        self._wake()

    def _wake(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def confirmed(self, sequence: int, wait_s: float = ACK_WAIT_S) -> int:
        """Returns once every watcher that confirms has applied event `sequence`, or, for
        those that have not within `wait_s`, once they are cut off and unheard for SILENT_S
        (they serve nothing then). Returns how many were cut off."""

        def late() -> list[_Watcher]:
            return [w for w in self._acking.values() if w.acked < sequence]

        deadline = time.monotonic() + wait_s
        while late() and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._progress.wait(), left)
            except TimeoutError:
                break
        laggards = late()
        for watcher in laggards:
            self._end(watcher)
        if laggards:
            last = max(w.last_sent for w in laggards)
            wait_s = max(0.0, last + SILENT_S - self._clock())
            log.warning(
                "watchers cut off: they did not confirm an invalidation; it is answered once "
                "they have gone unheard long enough to have stopped serving their copies",
                extra={"watchers": len(laggards), "wait_s": round(wait_s, 2)},
            )
            await self._sleep(wait_s)
        return len(laggards)

    def let_go(self, keys: list[str]) -> None:
        """Keys the exact index dropped (expired, or out of room): only key listings care, a
        copy of an entry keeps its own expiry."""
        if keys and self.key_watchers:
            self._flush_held()
            self._send(Event(entry_ids=keys), key_watchers_only=True, sequence=0)

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
            self._send(event, key_watchers_only=True, sequence=0)

    def _send(self, event: Event, *, key_watchers_only: bool, sequence: int) -> None:
        for watcher in list(self._watchers):
            if key_watchers_only and not watcher.keys:
                continue
            try:
                watcher.queue.put_nowait((event, sequence))
            except asyncio.QueueFull:
                # A watcher this far behind ends its stream; it drops its copy and starts over,
                # which is always safe, where a lost event would not be.
                self._end(watcher)

    def _add(self, watcher: _Watcher) -> None:
        self._watchers.add(watcher)
        self.key_watchers += watcher.keys
        if watcher.watch_id:
            self._acking[watcher.watch_id] = watcher

    def _discard(self, watcher: _Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.discard(watcher)
            self.key_watchers -= watcher.keys
        if self._acking.pop(watcher.watch_id, None) is not None:
            self._wake()  # an ended stream has nothing left to confirm

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
