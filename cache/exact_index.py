"""The exact tier's in-memory index: exact key -> the entry fields a hit needs.

Milvus stays the durable store; this index mirrors the entries this cache service has
written (and, after a restart, every live entry it rebuilt from Milvus), so an exact lookup
is a dict read instead of a Milvus query. It never decides anything Milvus would not:

- an entry whose `expires_at` has passed is never returned (and is dropped when seen);
- the caller re-checks the entry's scope before serving it, as for a Milvus read;
- invalidation (by key or by scope), eviction and expiry remove entries here as well.

Memory is bounded twice: by each (tenant, model)'s `max_entries` (eviction deletes from
Milvus and from here) and by `max_entries` of the whole index, past which the entries put
longest ago leave the index only (Milvus keeps them; see docs/cache.md).

An entry is held as a plain tuple of strings, bytes and floats, not as the `Entry` a lookup
gets back: the garbage collector stops tracking such a tuple after the first collection it
survives, where it walks every instance of a class on every full collection. With a million
`Entry` objects held, a full collection took 290 ms on the 2-core VM (the cache's event loop
stopped meanwhile), and the collector runs one each time the objects it tracks grow by a
quarter; held as tuples, none of them is walked (`tests/unit/test_gc_untracked.py`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice
from typing import Final

from hopline.cache.embedder import Vector
from hopline.cache.store import Entry, Scope, ScopeFilter
from hopline.cache.vector_index import VectorIndex

Group = tuple[str, str]  # tenant, model
# Entry without its key (the dict's key), as a plain tuple: see the module's docstring.
Row = tuple[Scope, str, bytes, float, float]
SCOPE: Final = 0
EXPIRES_AT: Final = 4


def _row(entry: Entry) -> Row:
    return (entry.scope, entry.text, entry.response, entry.created_at, entry.expires_at)


class ExactIndex:
    def __init__(self, max_entries: int, vectors: VectorIndex | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"the exact index needs room for one entry, got {max_entries}")
        self.max_entries = max_entries
        # Put order, oldest first: the order in which the whole-index bound drops entries.
        self._entries: OrderedDict[str, Row] = OrderedDict()
        # Each (tenant, model)'s keys in put order, oldest first: the order eviction takes.
        self._groups: dict[Group, dict[str, None]] = {}
        # (expires_at, key), lazily cleaned: a replaced or removed entry leaves a stale item
        # that `expire` skips; compacted when stale items outnumber live ones.
        self._expiry: list[tuple[float, str]] = []
        self.dropped_for_room = 0
        self._expired: list[str] = []  # dropped by `get` since the last `expire`, unreported
        # The semantic entries' vectors (cache/vector_index.py), kept in step with every
        # put and drop here; None when semantic searches go to Milvus.
        self.vectors = vectors

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str, now: float) -> Entry | None:
        row = self._entries.get(key)
        if row is None:
            return None
        if row[EXPIRES_AT] <= now:
            self._drop(key)
            self._expired.append(key)
            return None
        return Entry(key, *row)

    def put(self, entry: Entry, vector: Vector | None = None) -> list[str]:
        """Insert or replace, with the entry's vector when it is a semantic one; returns the
        keys dropped to stay within `max_entries`."""
        key = entry.key
        if key in self._entries:  # a replacement is as new as a first put
            self._drop(key)
        self._entries[key] = _row(entry)
        if vector is not None and self.vectors is not None:
            self.vectors.put(key, entry.scope, vector)
        self._groups.setdefault(_group(entry.scope), {})[key] = None
        heapq.heappush(self._expiry, (entry.expires_at, key))
        dropped: list[str] = []
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            if self.vectors is not None:  # Milvus still has it: the scope is not held whole
                self.vectors.lose(self._entries[oldest][SCOPE])
            self._drop(oldest)
            dropped.append(oldest)
        self.dropped_for_room += len(dropped)
        if len(self._expiry) > 2 * len(self._entries) + 1024:
            self._expiry = [(row[EXPIRES_AT], k) for k, row in self._entries.items()]
            heapq.heapify(self._expiry)
        return dropped

    def load(self, entries: Iterable[Entry], now: float) -> int:
        """Add live entries oldest first (so the whole-index bound keeps the newest)."""
        live = sorted((e for e in entries if e.expires_at > now), key=lambda e: e.created_at)
        for entry in live:
            self.put(entry)
        if self.vectors is not None:  # read without their vectors (VectorIndex.absorb)
            self.vectors.unread({entry.scope for entry in live})
        return len(self._entries)

    def remove(self, keys: Iterable[str]) -> int:
        removed = 0
        for key in keys:
            if key in self._entries:
                self._drop(key)
                removed += 1
        return removed

    def remove_scope(self, scope: ScopeFilter) -> int:
        doomed = [
            key
            for (tenant, model), keys in self._groups.items()
            if (not scope.tenant or scope.tenant == tenant)
            and (not scope.model or scope.model == model)
            for key in keys
            if not scope.model_version or self._entries[key][SCOPE][2] == scope.model_version
        ]
        return self.remove(doomed)

    def expire(self, now: float) -> list[str]:
        """Drop what expired by `now`; the keys dropped by expiry since the last call (lookups
        drop an expired entry when they meet it), for the key listings that mirror this index."""
        expired, self._expired = self._expired, []
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            row = self._entries.get(key)
            if row is not None and row[EXPIRES_AT] == expires_at:
                self._drop(key)
                expired.append(key)
        return expired

    def held(self) -> list[tuple[str, tuple[str, str, str, str]]]:
        """Every key with its scope, copied now (the watch feed's listing)."""
        return [(key, row[SCOPE]) for key, row in self._entries.items()]

    def groups(self) -> list[Group]:
        """Every (tenant, model) holding an entry here."""
        return list(self._groups)

    def count(self, tenant: str, model: str) -> int:
        return len(self._groups.get((tenant, model), ()))

    def oldest(self, tenant: str, model: str, n: int) -> list[str]:
        """The keys of (tenant, model)'s `n` entries put longest ago. Entries are put in the
        order their batched writes reach Milvus, and a rebuild loads them by `created_at`, so
        this is the store's oldest-first order but within one write batch."""
        return list(islice(self._groups.get((tenant, model), ()), n))

    def _drop(self, key: str) -> None:
        group = _group(self._entries.pop(key)[SCOPE])
        if self.vectors is not None:
            self.vectors.remove(key)
        keys = self._groups.get(group)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._groups[group]


def _group(scope: Scope) -> Group:
    return scope[0], scope[1]
