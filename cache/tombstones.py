"""Entries deleted a moment ago, hidden from lookups that read Milvus without waiting.

A Strong read waits for the server's next time tick: on a Milvus standalone a lookup's key
query or search took 199-201 ms at the default `proxy.timeTickInterval` (200 ms) and 39-41
ms at 20 ms, against the gateway's 40 ms cache budget, so every lookup that read the server
failed open; a Bounded read answered in 1.4-2.3 ms (tick 20 or 200). Bounded may read rows
up to the server's `common.gracefulTime` (5 s by default) old: an entry deleted within that
time can come back. For a cache only deletions matter (a store not yet visible is a miss,
an eviction's victim is still a right answer, but an invalidated entry must never be served
again), so lookups read Bounded and every entry this replica has deleted, or heard deleted
from another replica (cache/shared_invalidations.py), stays here for `keep_s`, longer than
the server's staleness bound; a read's results are checked against it.

Entries buried by scope are hidden whatever their age: a store made in the scope after the
invalidation is hidden too until the scope's stone expires (a short miss, never a stale hit;
comparing stamps would trust the replicas' clocks).

An invalidation whose Milvus delete failed is held (`hold`) until the writer's retry of it
lands (cache/writer.py), then buried as if deleted then (`release`): its entries are still
in Milvus, so they stay hidden, and their stores fenced, for however long that takes.

For the same reason a store that arrives while an invalidation's stone stands is not taken
(`fences`): the gateway holds its stores up to HOPLINE_GATEWAY_STORE_LINGER_MS before sending
them, so an answer computed before an Invalidate reached the cache after it and was served
again, for its whole TTL. A store answered after the invalidation is refused with it: a
repeat misses once more within keep_s. An eviction's stone fences nothing: its entry was right.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from hopline.cache.store import Entry, Scope, ScopeFilter


class Tombstones:
    """Recently deleted ids and scopes, each kept `keep_s` (monotonic seconds)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._ids: dict[str, float] = {}  # entry id -> until
        self._invalidated: dict[str, float] = {}  # of them, those an invalidation removed
        # The ids of each bury, oldest first, so expiry costs what expires: taking the dict's
        # oldest item one at a time walked every slot deleted before it (a dict does not
        # compact on deletion), quadratic in the ids expiring, and an Invalidate of 60,000
        # ids held the cache's event loop for minutes.
        self._buried: deque[tuple[float, tuple[str, ...]]] = deque()
        self._scopes: deque[tuple[ScopeFilter, float]] = deque()  # oldest first
        # Of failed deletes, until their retry lands (counted: two may hold one id or scope).
        self._held_ids: Counter[str] = Counter()
        self._held_scopes: Counter[ScopeFilter] = Counter()

    def bury(
        self,
        ids: Iterable[str],
        scope: ScopeFilter | None,
        now: float,
        *,
        invalidated: bool = True,
    ) -> None:
        """`invalidated`: removed by an invalidation (a store of them is fenced), not evicted."""
        until = now + self.keep_s
        self._prune(now)
        batch = tuple(ids)
        if batch:
            for key in batch:
                self._ids[key] = until
            if invalidated:
                self._invalidated.update(dict.fromkeys(batch, until))
            self._buried.append((until, batch))
        if scope is not None:
            self._scopes.append((scope, until))

    def hold(self, ids: Iterable[str], scope: ScopeFilter | None) -> None:
        """An invalidation Milvus has not deleted yet: hidden and fenced until `release`."""
        self._held_ids.update(ids)
        if scope is not None:
            self._held_scopes[scope] += 1

    def release(self, ids: Iterable[str], scope: ScopeFilter | None, now: float) -> None:
        """A held invalidation's delete landed: buried from `now`, as any delete is."""
        batch = tuple(ids)
        self._held_ids.subtract(batch)
        self._held_ids = +self._held_ids  # drops the ids no longer held
        if scope is not None:
            self._held_scopes[scope] -= 1
            self._held_scopes = +self._held_scopes
        self.bury(batch, scope, now)

    def hides(self, entry: Entry, now: float) -> bool:
        """Whether `entry`, as a read of Milvus returned it, was deleted within keep_s (or
        is held, its delete not landed)."""
        until = self._ids.get(entry.key)
        if until is not None and until > now:
            return True
        if entry.key in self._held_ids or self._held(entry.scope):
            return True
        return any(until > now and s.matches(entry.scope) for s, until in self._scopes)

    def fences(self, key: str, scope: Scope, now: float) -> bool:
        """Whether a store of `key` in `scope` arriving now may have been answered before an
        invalidation that removed it (module docstring): not taken."""
        until = self._invalidated.get(key)
        if until is not None and until > now:
            return True
        if key in self._held_ids or self._held(scope):
            return True
        return any(until > now and s.matches(scope) for s, until in self._scopes)

    def __len__(self) -> int:
        return len(self._ids) + len(self._scopes) + len(self._held_ids) + len(self._held_scopes)

    def _held(self, scope: Scope) -> bool:
        return any(s.matches(scope) for s in self._held_scopes)

    def _prune(self, now: float) -> None:
        while self._buried and self._buried[0][0] <= now:
            until, batch = self._buried.popleft()
            for key in batch:
                if self._ids.get(key) == until:  # not buried again since
                    del self._ids[key]
                if self._invalidated.get(key) == until:
                    del self._invalidated[key]
        while self._scopes and self._scopes[0][1] <= now:
            self._scopes.popleft()
