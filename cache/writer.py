"""The cache's write side: accepted stores wait in memory, visible to the exact tier at once,
until one task writes them to Milvus in batches, puts them into the exact index and holds
each (tenant, model) to its entry bound, oldest first (and a milvus-lite file to its bound on
all of them together, the largest groups first). While a reclaim's record of the writes is
full the stores wait (`CacheStore.stores_wait`).

`PendingWrites` works on the cache service's parts through `WriteHost` (cache/service.py is
the one host): the store, the exact index, the bounds' counts, the tombstones, the watch feed
and the other replicas over a shared Milvus server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from opentelemetry import context as otel_context
from opentelemetry.trace import Link, SpanContext

from hopline.cache.counts import CacheCount, CacheCounts
from hopline.cache.embedder import Vector
from hopline.cache.entry_bounds import EntryBounds, Group, eviction_size, fair_shares
from hopline.cache.exact_index import ExactIndex
from hopline.cache.peer_sync import PeerSync
from hopline.cache.shared_invalidations import SharedInvalidations
from hopline.cache.store import CacheStore, CacheStoreError, Entry, ScopeFilter
from hopline.cache.tombstones import Tombstones
from hopline.cache.watch_feed import WatchFeed
from hopline.observability import schema
from hopline.observability.tracing import tracer
from hopline.protos.hopline.cache.v1 import cache_pb2

log = logging.getLogger("hopline.cache")

# The writer's rows per Milvus write, oldest first. A write that fails (a timeout, Milvus
# down) stays pending and is tried again after a backoff from WRITE_RETRY_MIN_S doubling to
# WRITE_RETRY_MAX_S: a timed-out write may have landed, and dropping its rows then left them
# in Milvus but not in the exact index, so every later eviction of their (tenant, model)
# scanned Milvus for the oldest (100 tenants at their bounds after a burst: milvus-lite 6.7 ms
# of CPU a store against 0.35). Inserting 4,000 rows into a 100,000-row milvus-lite
# collection took 1.3-2.0 s on the 2-core VM, idle, and 1,000 rows 0.2 s: a write of at most
# this many stays well inside `milvus_timeout_s`, so a backlog cannot time out every retry.
WRITE_ROWS = 1024
WRITE_RETRY_MIN_S = 0.5
WRITE_RETRY_MAX_S = 10.0
# A store whose writes failed this many times is dropped (`store_errors`): a row Milvus keeps
# refusing must not hold every store behind it, oldest first, for ever.
MAX_WRITE_ATTEMPTS = 5
# Failures of this host rather than of the rows (a disk nearly full, `disk_note`'s words; no
# file descriptor left): a store waits them out as it waits out an outage. Counted against the
# stores, 208 acknowledged ones were dropped 25 s into a full disk, and 231 under a low fd
# limit, while Milvus answered reads (a resource-exhaustion probe).
HOST_SHORTAGES = ("probably full", "no space left", "disk is full", "too many open files")
# How often a writer held back by a reclaim (CacheStore.stores_wait) looks again.
STORES_WAIT_POLL_S = 0.1

# A pending store: the entry, its vector (the host's placeholder for an exact-only store)
# and its (tenant, model)'s entry bound.
Pending = tuple[Entry, Vector, int]


class LateInvalidation(NamedTuple):
    """An Invalidate whose Milvus delete failed, and the event to tell the replicas."""

    ids: list[str]
    scope: ScopeFilter | None
    event: cache_pb2.WatchInvalidationsResponse


class WriteHost(Protocol):
    """What the write side uses of the cache service."""

    index: ExactIndex | None
    bounds: EntryBounds
    tombstones: Tombstones
    feed: WatchFeed
    counts: CacheCounts
    peers: SharedInvalidations | None
    peer_sync: PeerSync | None  # with peers: the keys written, for their late deletes
    placeholder: Vector  # an exact-only store's vector: never put into the vector index

    def require_store(self) -> CacheStore: ...

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def share(self, event: cache_pb2.WatchInvalidationsResponse) -> None: ...


class PendingWrites:
    """Accepted stores not yet in Milvus, and the task that writes them (`run`)."""

    def __init__(self, host: WriteHost, flush_interval_s: float, max_total: int = 0) -> None:
        self.host = host
        self.flush_interval_s = flush_interval_s
        # The whole file's bound (cache/entry_bounds.py:total_bound_problem says when it can
        # be kept); 0: the groups' own bounds only.
        self.max_total = max_total
        self._pending: dict[str, Pending] = {}
        self._spans: dict[str, SpanContext] = {}  # for the write's span links
        self._wake = asyncio.Event()
        self._writing = 0  # entries of the batch being written and bounded right now
        # Invalidated while a write of them was in flight, to be deleted from Milvus again.
        self._redelete: set[str] = set()
        self._attempts: dict[str, int] = {}  # failed writes of a pending store, when any
        # Invalidations whose delete Milvus failed, oldest first: tried again with the writes,
        # their tombstones held until they land (cache/invalidation.py).
        self._invalidations: list[LateInvalidation] = []
        self._deletes_failing = False  # said once when they start failing, once when they land
        # Shutting down: stores are written even while a reclaim's journal is full (at most
        # HOPLINE_CACHE_MAX_PENDING of them), rather than lost with the process.
        self._draining = False

    def __len__(self) -> int:
        return len(self._pending)

    def in_flight(self) -> int:
        """Stores not yet written: those waiting and the batch being written."""
        return len(self._pending) + self._writing

    def get(self, key: str) -> Entry | None:
        pending = self._pending.get(key)
        return pending[0] if pending is not None else None

    def held(self) -> list[tuple[str, tuple[str, str, str, str]]]:
        """Every pending store's key and scope."""
        return [(key, entry.scope) for key, (entry, _, _) in self._pending.items()]

    def add(self, key: str, pending: Pending, span: SpanContext) -> None:
        """A store accepted: the exact tier reads it from now on, the writer writes it soon."""
        self._pending[key] = pending
        self._attempts.pop(key, None)  # a new store of the key starts afresh
        # Its write replaces whatever an earlier one left in Milvus; a re-delete still waiting
        # (see _delete_again) would delete it after that write, leaving the index without Milvus.
        self._redelete.discard(key)
        self._spans[key] = span
        self._wake.set()

    def drop(self, ids: list[str], scope: ScopeFilter | None) -> list[str]:
        """Pending stores invalidated (by id or scope) before the delete reaches Milvus, so
        the writer cannot resurrect them after it; their keys."""
        named = set(ids)
        dropped = [
            key
            for key, (entry, _, _) in self._pending.items()
            if key in named or (scope is not None and scope.matches(entry.scope))
        ]
        for key in dropped:
            self._unpend(key)
        return dropped

    def delete_again(self, keys: list[str]) -> None:
        """Deletes `keys` from Milvus at the writer's next turn (after a write in flight): a
        peer's delete may have run before their write landed (cache/peer_sync.py)."""
        if keys:
            self._redelete.update(keys)
            self._wake.set()

    def invalidate_later(self, late: LateInvalidation) -> None:
        """An invalidation whose delete Milvus failed: deleted at the writer's next turns
        until Milvus takes it, then told to the other replicas and its tombstones released."""
        self._invalidations.append(late)
        self._wake.set()

    def invalidations_pending(self) -> int:
        return len(self._invalidations)

    async def drain(self, timeout_s: float) -> None:
        """Let the writer land what was accepted: nothing acknowledged is lost on a drain."""
        deadline = time.monotonic() + timeout_s
        self._draining = True
        while (self._pending or self._invalidations) and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(0.01)
        if self._pending:
            log.warning(
                "stores not written to Milvus before shutdown",
                extra={"entries": len(self._pending)},
            )
        if self._invalidations:
            # Nothing else holds them: the next start reads the entries from Milvus again.
            log.error(
                "invalidations not deleted from Milvus before shutdown: their entries are "
                "served again after the restart; invalidate them again then",
                extra={"invalidations": len(self._invalidations)},
            )

    async def run(self) -> None:
        """Writes the pending stores to Milvus, oldest first, at most WRITE_ROWS a write; a
        write that fails is tried again after a backoff, not dropped (see WRITE_ROWS)."""
        backoff_s = 0.0
        writes_failed = False  # since the last write that succeeded (deletes apart)
        await self._evict({})  # a file started over a lowered whole-file bound
        while True:
            await self._wake.wait()
            await asyncio.sleep(max(self.flush_interval_s, backoff_s))
            if self.host.require_store().stores_wait():
                await self._wait_for_reclaim()
            self._wake.clear()
            batch = dict(itertools.islice(self._pending.items(), WRITE_ROWS))
            if batch:
                self._writing = len(batch)
                try:
                    failure = await self._write(batch)
                finally:
                    self._writing = 0
            else:  # deletes alone, backed off as writes are: Milvus may be down
                failure = await self._delete_again()
            if failure is None:
                if writes_failed and batch:  # after failed writes: said once, as they were
                    log.info("cache writes succeed again", extra={"entries": len(batch)})
                    writes_failed = False
                backoff_s = 0.0
            else:
                backoff_s = min(max(2 * backoff_s, WRITE_RETRY_MIN_S), WRITE_RETRY_MAX_S)
                if batch:
                    writes_failed = True
                    log.warning(
                        "cache write failed; retrying",
                        extra={"error": failure, "entries": len(batch), "retry_in_s": backoff_s},
                    )
            if self._pending or self._redelete or self._invalidations:
                self._wake.set()

    async def _wait_for_reclaim(self) -> None:
        """Holds the stores back while a reclaim's journal is full (cache/generations.py:
        JOURNAL_MAX_ROWS); it empties in a Milvus thread, so it is polled."""
        self.host.counts.add(CacheCount.WRITES_HELD)
        log.info("cache stores wait for the reclaim's copy", extra={"entries": len(self)})
        while self.host.require_store().stores_wait() and not self._draining:  # noqa: ASYNC110
            await asyncio.sleep(STORES_WAIT_POLL_S)

    async def _write(self, batch: dict[str, Pending]) -> str | None:
        """One batched write and what follows it (index, invalidations, bounds); the error
        when Milvus failed it, with the batch left pending to be written again."""
        host = self.host
        # Off every request's path: a trace of its own, linked once to each store call it
        # writes (a StoreBatch's entries share one: 10 entries made 10 links to it).
        stores = {(c.trace_id, c.span_id): c for c in (self._spans.get(k) for k in batch) if c}
        links = [Link(c) for c in stores.values()]
        try:
            with tracer().start_as_current_span(
                schema.SPAN_CACHE_WRITE,
                context=otel_context.Context(),
                links=links,
                attributes={schema.CACHE_ENTRIES: len(batch)},
            ):
                await host.io_call(
                    host.require_store().upsert, [(e, v) for e, v, _ in batch.values()]
                )
        except ValueError as exc:  # rows Milvus refuses: writing them again cannot help
            host.counts.add(CacheCount.STORE_ERRORS, len(batch))
            log.warning("cache write refused", extra={"error": str(exc), "entries": len(batch)})
            for key, item in batch.items():
                if self._pending.get(key) is item:
                    self._unpend(key)
            return None
        except CacheStoreError as exc:
            # A write that timed out may have landed all the same: invalidated meanwhile,
            # its keys are deleted again below, the rest are written again (an upsert).
            host.counts.add(CacheCount.WRITE_RETRIES)
            self._redelete.update(k for k in batch if k not in self._pending)
            short = any(words in str(exc).lower() for words in HOST_SHORTAGES)
            if not short and await self._answers(batch):
                self._failed_again(batch)
            await self._delete_again()
            return str(exc)
        if host.peer_sync is not None:
            host.peer_sync.landed((key, entry.scope) for key, (entry, _, _) in batch.items())
        for key, item in batch.items():
            if self._pending.get(key) is item:  # a newer store of the same key stays queued
                self._unpend(key)
                if host.index is not None:
                    entry, vector, _ = item
                    semantic = vector is not host.placeholder
                    host.feed.let_go(host.index.put(entry, vector if semantic else None))
            elif key not in self._pending:
                self._redelete.add(key)
        # Invalidated while this write was in flight: its delete may have reached Milvus
        # before the write did, so delete again rather than resurrect them.
        await self._delete_again()
        groups: dict[Group, int] = {}
        for entry, _, limit in batch.values():
            group = (entry.scope[0], entry.scope[1])
            groups[group] = limit
            host.bounds.wrote(group, 1)
        await self._evict(groups)
        return None

    async def _answers(self, batch: dict[str, Pending]) -> bool:
        """Whether Milvus answers a read (a key of `batch` looked up) after a write failed: a
        write failed while Milvus answers reads counts against its stores (a row it keeps
        refusing must not hold every store behind it); one failed while it answers nothing
        does not, so stores the cache acknowledged wait out an outage of any length (they
        were dropped after five writes, about 20 s into one)."""
        host = self.host
        try:
            await host.io_call(host.require_store().get, next(iter(batch)), time.time())
        except CacheStoreError:
            return False
        return True

    def _failed_again(self, batch: dict[str, Pending]) -> None:
        """Counts a failed write for each of the batch's stores still pending, and drops
        those that failed MAX_WRITE_ATTEMPTS times. A failed write may have landed (a timeout),
        so a dropped key the index does not hold is deleted from Milvus again (as an entry
        invalidated in flight is): the index and Milvus keep the same keys. One the index
        holds keeps its row, the earlier store's or a landed write of this one's."""
        index = self.host.index
        dropped = []
        for key, item in batch.items():
            if self._pending.get(key) is not item:
                continue
            attempts = self._attempts.get(key, 0) + 1
            if attempts < MAX_WRITE_ATTEMPTS:
                self._attempts[key] = attempts
                continue
            self._unpend(key)
            dropped.append(key)
            if index is not None and key not in index:
                self._redelete.add(key)
        if dropped:
            self.host.counts.add(CacheCount.STORE_ERRORS, len(dropped))
            self.host.feed.let_go(dropped)
            log.error(
                "cache stores dropped: Milvus failed every write of them",
                extra={"entries": len(dropped), "attempts": MAX_WRITE_ATTEMPTS},
            )

    def _unpend(self, key: str) -> None:
        """A pending store leaves the buffer (written, given up, or invalidated)."""
        del self._pending[key]
        self._spans.pop(key, None)
        self._attempts.pop(key, None)

    async def _delete_again(self) -> str | None:
        """Deletes the keys invalidated while a write of them was in flight, stores given up
        after writes that may have landed, and invalidations Milvus failed to delete; kept for
        the next turn when Milvus fails this one too (its error returned)."""
        if not (self._redelete or self._invalidations):
            return None
        failure: str | None = None
        keys = list(self._redelete)
        if keys:
            try:
                await self.host.io_call(self.host.require_store().delete, keys)
                self._redelete.difference_update(keys)
            except CacheStoreError as exc:
                failure = str(exc)
        # Each on its own, a failed one to the back: one scope whose delete keeps failing (a
        # large one timing out) held every invalidation behind it (a reviewer's snippet).
        for late in list(self._invalidations):
            try:
                await self._land(late)
            except Exception as exc:  # any: raised out of here it would end the writer
                failure = str(exc) or type(exc).__name__
                self._invalidations.remove(late)
                self._invalidations.append(late)
            else:
                self._invalidations.remove(late)
        if failure is not None:
            if not self._deletes_failing:  # an outage is said once, not at every retry
                log.warning(
                    "deleting invalidated entries from Milvus failed; retrying",
                    extra={"error": failure, "invalidations": len(self._invalidations)},
                )
            self._deletes_failing = True
            return failure
        if self._deletes_failing:
            log.info("invalidated entries deleted from Milvus again")
            self._deletes_failing = False
        return None

    async def _land(self, late: LateInvalidation) -> None:
        """A failed invalidation's delete, tried again; then what followed it had it
        succeeded: the index once more, the other replicas told, the tombstones from now."""
        host = self.host
        store = host.require_store()
        await host.io_call(store.delete, late.ids)
        if late.scope is not None:
            await host.io_call(store.delete_scope, late.scope)
        if host.index is not None:
            host.index.remove(late.ids)
            if late.scope is not None:
                host.index.remove_scope(late.scope)
        await host.share(late.event)
        host.tombstones.release(late.ids, late.scope, time.monotonic())
        log.info(
            "invalidation deleted from Milvus after its failure",
            extra={"entries": len(late.ids), "scope": late.scope is not None},
        )

    async def _evict(self, groups: dict[Group, int]) -> None:
        """Oldest first, per (tenant, model): one tenant's traffic never evicts another's
        within its bound, nor within its fair share of the whole file's (`_over_total`).
        Milvus is counted only when a group may be over its bound (cache/entry_bounds.py), and
        every group's victims of one write go in one delete: milvus-lite's delete costs about
        the same for one id as for thousands."""
        host = self.host
        store = host.require_store()
        chosen: dict[Group, list[str]] = {}
        for group, limit in groups.items():
            try:
                if doomed := await self._victims(store, group, limit):
                    chosen[group] = doomed
            except CacheStoreError as exc:
                log.warning("eviction failed", extra={"error": str(exc)})
        for_file = self._over_total(chosen)
        if not chosen:
            return
        doomed = [key for keys in chosen.values() for key in keys]
        try:
            removed = await host.io_call(store.delete, doomed)
        except CacheStoreError as exc:
            log.warning("eviction failed", extra={"error": str(exc), "entries": len(doomed)})
            return
        host.counts.add(CacheCount.EVICTIONS, removed)
        host.counts.add(CacheCount.FILE_EVICTIONS, min(for_file, removed))
        for group, keys in chosen.items():
            if removed == len(doomed):
                host.bounds.evicted(group, len(keys))
            else:  # which group lost fewer is unknown: count them all again
                host.bounds.forget(group)
        if host.index is not None:
            host.index.remove(doomed)
        host.tombstones.bury(doomed, None, time.monotonic(), invalidated=False)
        evicted = cache_pb2.WatchInvalidationsResponse(entry_ids=doomed)
        host.feed.publish(evicted)
        await host.share(evicted)

    def _over_total(self, chosen: dict[Group, list[str]]) -> int:
        """Adds to `chosen` the victims that bring the whole file back within `max_total`, a
        headroom below it, from the groups holding the most (`fair_shares`), each its oldest;
        returns how many. The exact index holds every entry of the file
        (`total_bound_problem`), so its counts are the file's; an entry expired but not yet
        swept counts, so this errs early."""
        index = self.host.index
        if not self.max_total or index is None:
            return 0
        total = len(index) - sum(len(keys) for keys in chosen.values())
        if not (excess := eviction_size(total, self.max_total)):
            return 0
        added = 0
        counts = {
            group: index.count(*group) - len(chosen.get(group, ())) for group in index.groups()
        }
        for group, share in fair_shares(counts, excess).items():
            taken = chosen.setdefault(group, [])
            already = set(taken)
            oldest = index.oldest(*group, len(taken) + share)
            victims = [key for key in oldest if key not in already][:share]
            taken.extend(victims)
            added += len(victims)
        return added

    async def _victims(self, store: CacheStore, group: Group, limit: int) -> list[str]:
        """The group's oldest entries past its bound, down to the headroom; none under it."""
        host = self.host
        now = time.monotonic()
        if not host.bounds.needs_count(group, limit, now):
            return []
        tenant, model = group
        count = await host.io_call(store.count, tenant, model)
        host.bounds.counted(group, count, now)
        if not (excess := eviction_size(count, limit)):
            return []
        if (doomed := self._oldest_held(tenant, model, count, excess)) is not None:
            return doomed
        host.counts.add(CacheCount.EVICTION_SCANS)
        oldest: list[str] = await host.io_call(store.oldest, tenant, model, excess)
        return oldest

    def _oldest_held(self, tenant: str, model: str, count: int, n: int) -> list[str] | None:
        """The group's `n` oldest from the exact index, when it holds every entry Milvus just
        counted for the group; None when only Milvus can say.

        Scanning Milvus for them reads every row's id and age, in pages: 0.36-0.38 s for a
        94,500-entry group in milvus-lite, once per `HEADROOM` of stores. The
        index holds what this process wrote and rebuilt but for the index bound's drops,
        expired entries and stores still on their way, so equal counts mean the same
        entries. Over a shared Milvus server (`peers`) other replicas write too: Milvus is
        scanned."""
        index = self.host.index
        if index is None or self.host.peers is not None:
            return None
        if index.count(tenant, model) != count:
            return None
        return index.oldest(tenant, model, n)
