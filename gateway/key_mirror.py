"""The exact keys the cache holds, mirrored in the gateway: an exact-only miss skips the Lookup.

For a model whose cache policy is exact, the cache answers a lookup from its in-memory index
alone (the default: cache/service.py's `_lists_keys`). So a key the cache does not hold is a
miss known in advance, and the Lookup RPC beside the model is pure cost: on 2 cores the
cache process's lookup competed with the model for CPU (co-located, miss, c=1: p50 9.11 ->
7.80 ms without it; c=32: 200 -> 220 rps, a throwaway measurement that skipped it outright).

The cache lists its keys on the WatchInvalidations stream (`keys`), then sends each key a
store adds and each it drops (cache/watch_feed.py). The mirror is used only between the
listing's end (`keys_synced`) and the stream's end, like the local exact tier's copy.

Errors cost speed, never answers:
- A key the mirror holds but the cache does not (a write that failed, a drop not heard yet)
  is looked up as before and misses.
- A key the cache holds but the mirror does not yet (another gateway's store, sent within
  cache/watch_feed.py's HELD_FLUSH_S) runs the model once more, as a miss at a cache replica
  that has not seen the store would. This gateway's own stores are added when they are sent,
  so a repeat that comes before the store returns is looked up (the cache's pending writes
  answer it), never vouched a miss.

Keys are kept as their first 64 bits (about 90 bytes an entry with the dict's slot, against
about 180 for the hex string): two keys sharing them make one look held, which is the safe
side. Past `capacity` keys the mirror stops answering until the stream starts over.

A scope invalidation (an operator's, one tenant's or version's keys) must not stop the event
loop for as long as walking every key takes: 553 ms for 2 million keys (the default
capacity), 25 ms for 100,000, during which every request of this gateway waited. Each
scope's keys point at one shared `_Held`; the invalidation marks it dropped, which answers
for all its keys at once, and a task deletes them afterwards a chunk at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from hopline.cache.keys import scope_matches
from hopline.observability import metrics
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.gateway.key_mirror")

Scope = tuple[str, str, str]  # tenant, model, version: what a scope invalidation names
# Keys looked at between two turns of the event loop while a dropped scope's keys are deleted
# (about 2 ms of loop time here).
PURGE_CHUNK = 5_000


class _Held:
    """One scope's keys' shared value: dropped once the scope is invalidated."""

    __slots__ = ("dropped",)

    def __init__(self) -> None:
        self.dropped = False


def fingerprint(key: str) -> int:
    """The first 64 bits of a hex exact key."""
    return int(key[:16], 16)


class KeyMirror:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.synced = False  # the listing has ended on the live stream
        self.full = False  # past capacity: not answering until the next stream
        self._keys: dict[int, _Held] = {}
        self._scopes: dict[Scope, _Held] = {}  # the live one per scope, shared by its keys
        self._purging: asyncio.Task[None] | None = None
        self._purge_again = False  # a scope was dropped while a purge ran

    def __len__(self) -> int:
        return len(self._keys)

    def known_miss(self, key: str) -> bool:
        """True when the cache certainly does not hold `key` (for an exact-only lookup)."""
        if not self.synced or self.full:
            return False
        held = self._keys.get(fingerprint(key))
        return held is None or held.dropped

    def reset(self) -> None:
        """A new stream, or none: nothing is known until a listing ends."""
        self.synced = self.full = False
        self._keys.clear()
        self._scopes.clear()
        metrics.KEY_MIRROR_KEYS.set(0)

    def apply(self, event: cache_pb2.WatchInvalidationsResponse) -> None:
        for group in event.held:
            self.hold(group.scope, group.entry_ids)
        self.drop(event.entry_ids)
        if event.HasField("scope"):
            self.drop_scope(event.scope)
        if event.keys_synced:
            self.synced = True
            log.info("key mirror synced", extra={"keys": len(self._keys), "full": self.full})
        metrics.KEY_MIRROR_KEYS.set(len(self._keys))

    def hold(self, scope: common_pb2.Scope, keys: Iterable[str]) -> None:
        """Keys the cache holds under `scope` (a listing, a store event, or our own store)."""
        if self.full or self.capacity <= 0:
            return
        triple = (scope.tenant, scope.model, scope.model_version)
        shared = self._scopes.get(triple)
        if shared is None:
            shared = self._scopes[triple] = _Held()
        for key in keys:
            self._keys[fingerprint(key)] = shared
        if len(self._keys) > self.capacity:
            log.warning(
                "key mirror full: exact-only misses are looked up until the watch restarts",
                extra={"capacity": self.capacity},
            )
            self.full = True
            self._keys.clear()
            self._scopes.clear()

    def drop(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys.pop(fingerprint(key), None)

    def drop_scope(self, scope: common_pb2.Scope) -> None:
        """At once for every key of the scopes it covers; their entries go later (`_purge`)."""
        want = (scope.tenant, scope.model, scope.model_version)
        doomed = [triple for triple in self._scopes if scope_matches(want, triple)]
        for triple in doomed:
            self._scopes.pop(triple).dropped = True
        if doomed:
            self._purge_later()

    def _purge_later(self) -> None:
        if self._purging is not None and not self._purging.done():
            self._purge_again = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to yield to (a tool, a test): all now
            self._purge_chunk(list(self._keys))
            return
        self._purging = loop.create_task(self._purge())

    async def _purge(self) -> None:
        """Delete dropped scopes' keys a chunk at a time, yielding to requests in between
        (the listing of keys to look at is taken at once: about 10 ms for 2 million)."""
        while True:
            self._purge_again = False
            fingerprints = list(self._keys)
            for start in range(0, len(fingerprints), PURGE_CHUNK):
                self._purge_chunk(fingerprints[start : start + PURGE_CHUNK])
                await asyncio.sleep(0)
            if not self._purge_again:
                break
        metrics.KEY_MIRROR_KEYS.set(len(self._keys))

    def _purge_chunk(self, fingerprints: list[int]) -> None:
        keys = self._keys
        for fp in fingerprints:
            held = keys.get(fp)
            if held is not None and held.dropped:
                del keys[fp]
