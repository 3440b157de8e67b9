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

Keys are kept as their first 64 bits (about 70 bytes an entry with the dict's slot, against
about 180 for the hex string): two keys sharing them make one look held, which is the safe
side. Past `capacity` keys the mirror stops answering until the stream starts over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from hopline.cache.keys import scope_matches
from hopline.observability import metrics
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.gateway.key_mirror")

Scope = tuple[str, str, str]  # tenant, model, version: what a scope invalidation names


def fingerprint(key: str) -> int:
    """The first 64 bits of a hex exact key."""
    return int(key[:16], 16)


class KeyMirror:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.synced = False  # the listing has ended on the live stream
        self.full = False  # past capacity: not answering until the next stream
        self._keys: dict[int, Scope] = {}
        self._scopes: dict[Scope, Scope] = {}  # one tuple per scope, shared by its keys

    def __len__(self) -> int:
        return len(self._keys)

    def known_miss(self, key: str) -> bool:
        """True when the cache certainly does not hold `key` (for an exact-only lookup)."""
        return self.synced and not self.full and fingerprint(key) not in self._keys

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
        shared = self._scopes.setdefault(triple, triple)
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
        want = (scope.tenant, scope.model, scope.model_version)
        doomed = {triple for triple in self._scopes if scope_matches(want, triple)}
        if doomed:
            self._keys = {k: s for k, s in self._keys.items() if s not in doomed}
            for triple in doomed:
                del self._scopes[triple]
