"""The gateway's local exact tier: exact repeats answered without a hop to the cache.

A bounded LRU copy of exact entries the gateway has seen: the cache's EXACT hits, and the
gateway's own stores once the cache has accepted them. Keys are the cache's own exact keys
(SHA-256 over the full scope and the normalised text), so the scope rules are the cache's:
another tenant, model, version or top_k is another key.

Coherence with the cache, which stays the source of truth:
- The copy is served only while a WatchInvalidations stream to the cache is live. The first
  message of a stream clears the copy; a broken or ended stream clears it again and stops
  serving until a new stream is live. A gateway never serves what it cannot hear about:
  a stream that says nothing for HEARTBEATS_MISSED of the periods the cache promised
  (`heartbeat_ms`; it sends an empty message when quiet) is taken for lost, as behind a
  silent network partition, which only gRPC's keepalive found, 15 s later.
- Invalidations (by ids or by scope) and evictions arrive on the stream and drop entries.
  Each one applied is confirmed to the cache (`Acks`), which answers its Invalidate only
  then: answered as soon as the event was queued, the call returned while the event was on
  its way, and a gateway worker answered the invalidated entry 1-3 ms after it.
- Each event bumps a generation. A copy is taken only if no event arrived while the lookup
  or store that produced it was in flight, so a hit read just before an invalidation landed
  cannot be copied after the event that should have dropped it.
- An entry expires at the cache entry's own expiry (created + the model's ttl_s).
- For FENCE_S after an event, nothing it names is copied in at all. With several cache
  replicas the event comes from one of them, and another may not have read the shared
  invalidation log yet (cache/shared_invalidations.py: a poll's time): a lookup sent to it
  after the event, so past the generation check, answered the invalidated entry, and the
  copy was served for its whole TTL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Awaitable, Callable

import grpc

from hopline.cache.keys import scope_matches
from hopline.gateway.key_mirror import KeyMirror
from hopline.observability import metrics
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.gateway.exact_tier")

Scope = tuple[str, str, str, str]  # tenant, model, version, parameters (as in the cache key)
Watch = Callable[[], AsyncIterable[cache_pb2.WatchInvalidationsResponse]]
# Confirms to the cache that this watcher applied its stream's events up to a sequence.
Ack = Callable[[str, int], Awaitable[None]]


class Acks:
    """The confirmations of one gateway's watch: at most one call on its way, each naming
    the latest event applied (an Invalidate waits for them, so they are not batched)."""

    def __init__(self, send: Ack) -> None:
        self._send = send
        self._wanted: tuple[str, int] | None = None  # applied, not yet sent
        self._task: asyncio.Task[None] | None = None

    def applied(self, watch_id: str, sequence: int) -> None:
        self._wanted = (watch_id, sequence)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._wanted is not None:
            (watch_id, sequence), self._wanted = self._wanted, None
            try:
                await self._send(watch_id, sequence)
            except grpc.aio.AioRpcError as err:
                # The cache then cuts this watch off after its wait, and the tier starts over:
                # what it copied cannot outlive an invalidation either way.
                log.debug("invalidation not confirmed", extra={"status": err.code().name})

    def cancel(self) -> None:
        self._wanted = None
        if self._task is not None:
            self._task.cancel()


@dataclasses.dataclass(frozen=True)
class LocalEntry:
    prediction: common_pb2.Prediction
    scope: Scope
    created_at: float  # wall clock, as the cache records it
    expires_at: float


# A watch live this long holds: its loss starts the reconnects' backoff afresh, and ends an
# episode of watches that kept ending soon after they opened. Reset at each live stream, the
# backoff let a link that cut every connection after a few KB (a proxy's byte limit, under
# load) drop the tier three times a second, each drop a log line pair, a cleared copy and a
# full resync of the key mirror (a network-fault probe: 118 lines in 15 s).
STEADY_S = 10.0


class WatchEpisodes:
    """The watch's losses as an operator reads them: the first of an episode logged, the
    drops of a watch that keeps ending within STEADY_S of going live counted, and the end
    said once a watch has held STEADY_S."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._live_since: float | None = None
        self._flapping_since: float | None = None
        self._drops = 0

    def live(self) -> None:
        self._live_since = self._clock()
        if self._flapping_since is None:
            log.info("local exact tier live")

    def held(self) -> bool:
        """Whether the live watch has held STEADY_S; ends an episode of drops, saying so."""
        now = self._clock()
        if self._live_since is None or now - self._live_since < STEADY_S:
            return False
        if self._flapping_since is not None:
            log.info(
                "local exact tier live and steady again",
                extra={"drops": self._drops, "since_s": round(now - self._flapping_since, 1)},
            )
            self._flapping_since, self._drops = None, 0
        return True

    def lost(self, reason: str) -> bool:
        """The live watch ended; True when it had held (the reconnects start afresh)."""
        held = self.held()
        self._live_since = None
        if self._flapping_since is not None:
            self._drops += 1
            return held
        log.info("local exact tier off until the cache answers", extra={"reason": reason})
        if not held:  # further drops are counted until a watch holds
            self._flapping_since, self._drops = self._clock(), 1
        return held


# How long an invalidation's keys and scope are kept out of the copy: past any replica's
# poll of the shared log (HOPLINE_CACHE_PEER_POLL_MS, 100 ms by default), as the cache keeps
# its own tombstones (HOPLINE_CACHE_TOMBSTONE_S, 10 s).
FENCE_S = 10.0
MAX_FENCED_KEYS = 100_000  # evictions arrive as events too: the oldest fences go first
# Heartbeats a stream may miss before it is taken for lost: a loaded cache's loop can be a
# period late, and each loss costs the copy (it is cleared and filled again).
HEARTBEATS_MISSED = 3


class LocalExactTier:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.live = False
        self.generation = 0
        self._entries: OrderedDict[str, LocalEntry] = OrderedDict()
        self.hits = 0
        self._clock = clock
        # Keys and scopes events named in the last FENCE_S, with when (oldest first).
        self._fenced_keys: OrderedDict[str, float] = OrderedDict()
        self._fenced_scopes: list[tuple[tuple[str, str, str], float]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> LocalEntry | None:
        if not self.live:
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= now:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, entry: LocalEntry, generation: int) -> None:
        """Copy an entry read or written when the generation was `generation`."""
        if not self.live or generation != self.generation or self.capacity <= 0:
            return
        if self._fenced(key, entry.scope):
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        metrics.LOCAL_EXACT_ENTRIES.set(len(self._entries))

    def _fenced(self, key: str, scope: Scope) -> bool:
        """Whether an event in the last FENCE_S named `key` or a scope covering `scope`."""
        oldest = self._clock() - FENCE_S
        keys = self._fenced_keys
        while keys and next(iter(keys.values())) < oldest:
            keys.popitem(last=False)
        scopes = self._fenced_scopes
        if scopes and scopes[0][1] < oldest:
            self._fenced_scopes = scopes = [(w, at) for w, at in scopes if at >= oldest]
        return key in keys or any(scope_matches(w, scope) for w, _ in scopes)

    def apply(self, event: cache_pb2.WatchInvalidationsResponse) -> None:
        self.generation += 1
        now = self._clock()
        for key in event.entry_ids:
            self._entries.pop(key, None)
            self._fenced_keys.pop(key, None)
            self._fenced_keys[key] = now
        while len(self._fenced_keys) > MAX_FENCED_KEYS:
            self._fenced_keys.popitem(last=False)
        if event.HasField("scope"):
            want = (event.scope.tenant, event.scope.model, event.scope.model_version)
            self._fenced_scopes.append((want, now))
            # Matched once per distinct scope, not per entry: 14 ms for the default 10,000
            # entries on the event loop, about a fifth of that this way.
            scopes = {entry.scope for entry in self._entries.values()}
            doomed = {scope for scope in scopes if scope_matches(want, scope)}
            for key in [k for k, entry in self._entries.items() if entry.scope in doomed]:
                del self._entries[key]
        metrics.LOCAL_EXACT_ENTRIES.set(len(self._entries))

    def reset(self, live: bool) -> None:
        self.generation += 1
        self.live = live
        self._entries.clear()
        metrics.LOCAL_EXACT_ENTRIES.set(0)

    async def follow(
        self,
        watch: Watch,
        mirror: KeyMirror,
        max_retry_s: float = 2.0,
        *,
        ack: Ack | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Hold a watch stream to the cache for good, serving (this copy, and `mirror`'s
        keys) only while one is live; a lost one is tried again after a backoff that starts
        afresh only once a watch has held (STEADY_S). With `ack`, each event the cache
        numbers is confirmed once applied."""
        retry_s = 0.1
        episodes = WatchEpisodes(clock)
        acks = Acks(ack) if ack is not None else None
        try:
            await self._follow(watch, mirror, max_retry_s, acks, sleep, episodes, retry_s)
        finally:
            if acks is not None:
                acks.cancel()

    async def _follow(
        self,
        watch: Watch,
        mirror: KeyMirror,
        max_retry_s: float,
        acks: Acks | None,
        sleep: Callable[[float], Awaitable[None]],
        episodes: WatchEpisodes,
        retry_s: float,
    ) -> None:
        while True:
            stream = watch()
            messages = aiter(stream)
            silence_s: float | None = None  # until the cache promises heartbeats
            watch_id = ""  # where the cache takes confirmations
            try:
                while True:
                    try:
                        async with asyncio.timeout(silence_s):
                            event = await anext(messages)
                    except StopAsyncIteration:
                        reason = "stream ended"
                        break
                    except TimeoutError:
                        if isinstance(stream, grpc.aio.Call):
                            stream.cancel()
                        reason = f"nothing heard from the cache for {silence_s:g} s"
                        break
                    if event.heartbeat_ms:
                        silence_s = HEARTBEATS_MISSED * event.heartbeat_ms / 1e3
                    if event.live:
                        self.reset(live=True)
                        mirror.reset()
                        episodes.live()
                        watch_id = event.watch_id
                        continue
                    episodes.held()  # a watch that has held ends an episode of drops
                    if event.held or event.keys_synced:
                        mirror.apply(event)  # keys the cache holds: nothing here to drop
                    elif event.entry_ids or event.HasField("scope"):
                        self.apply(event)
                        mirror.apply(event)
                        if acks is not None and watch_id and event.sequence:
                            acks.applied(watch_id, event.sequence)
                    # else a heartbeat: the stream is alive
            except grpc.aio.AioRpcError as err:
                reason = err.code().name
            except asyncio.CancelledError:
                # A channel closed under the stream (renewed TLS files: the old channels close
                # after a grace) cancels the call, and with it this task's await; only a
                # cancel of this task ends the watch, or the tier would stay live, deaf.
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise
                reason = "channel closed"
            if self.live and episodes.lost(reason):
                retry_s = 0.1
            self.reset(live=False)
            mirror.reset()
            await sleep(retry_s)
            retry_s = min(max_retry_s, retry_s * 2)
