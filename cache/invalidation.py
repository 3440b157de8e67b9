"""Entries removed by an Invalidate, by another replica's invalidation or eviction, in the
order that keeps every reader from serving them again.

The pending writes first (the writer cannot resurrect them after the delete), then the exact
index (no lookup is answered from memory after that), then the tombstones (nor from a read of
Milvus that lags the delete); then Milvus itself, the index once more (a store written while
the delete ran is gone from Milvus too), and only then the event for the gateways' watches
and the other replicas (a lookup that starts after the event cannot read the entry any more);
the call is answered once the watching gateways confirm they applied it (WatchFeed.confirmed).

Another replica's event is applied the same way but for Milvus, which that replica already
deleted from: only what this replica wrote too late for that delete is deleted again
(cache/peer_sync.py says why).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from hopline.cache.exact_index import ExactIndex
from hopline.cache.peer_sync import PeerSync
from hopline.cache.store import CacheStoreError, ScopeFilter
from hopline.cache.tombstones import Tombstones
from hopline.cache.watch_feed import WatchFeed
from hopline.cache.writer import LateInvalidation
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

Event = cache_pb2.WatchInvalidationsResponse


class NotShared(CacheStoreError):
    """Deleted here, but the other replicas on the Milvus server were not told."""


class NotDeleted(CacheStoreError):
    """Milvus failed the delete: hidden from every reader of this replica, and deleted when
    the writer's retry lands (PendingWrites.invalidate_later)."""


class Drops(Protocol):
    def drop(self, ids: list[str], scope: ScopeFilter | None) -> list[str]: ...

    def delete_again(self, keys: list[str]) -> None: ...

    def invalidate_later(self, late: LateInvalidation) -> None: ...


class Deletes(Protocol):
    def delete(self, keys: Sequence[str]) -> int: ...

    def delete_scope(self, scope: ScopeFilter) -> int: ...


class ReplicaLog(Protocol):
    def append(self, event: Event) -> None: ...


class InvalidationHost(Protocol):
    """What an invalidation uses of the cache service (read-only: it calls, never assigns)."""

    @property
    def index(self) -> ExactIndex | None: ...

    @property
    def peers(self) -> ReplicaLog | None: ...

    @property
    def writes(self) -> Drops: ...

    @property
    def tombstones(self) -> Tombstones: ...

    @property
    def feed(self) -> WatchFeed: ...

    @property
    def peer_sync(self) -> PeerSync | None: ...

    def require_store(self) -> Deletes: ...

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


async def invalidate(host: InvalidationHost, ids: list[str], scope: ScopeFilter | None) -> int:
    """Removes the entries `ids` and, with a scope, every entry of it; returns the rows Milvus
    deleted. Raises NotDeleted when Milvus fails the delete, NotShared when only the
    replicas' notice does."""
    unwritten = forget(host, ids, scope).unwritten
    store = host.require_store()
    event = Event(scope=_scope_message(scope), entry_ids=ids)
    try:
        removed: int = unwritten + await host.io_call(store.delete, ids)
        if scope is not None:
            removed += await host.io_call(store.delete_scope, scope)
    except BaseException as exc:
        # Hidden here and at the gateways until the writer's retry lands: the tombstones
        # alone lapsed after keep_s and the entries were served again (a cache probe: a full
        # disk, 60 of 60), and a restart brought them back for good. A call cancelled while
        # its delete waited (the caller's deadline, queued behind an outage) is held too:
        # the delete may or may not have run, and running it again is harmless.
        host.tombstones.hold(ids, scope)
        host.writes.invalidate_later(LateInvalidation(ids, scope, event))
        sequence = host.feed.publish(event, awaited=True)
        if isinstance(exc, CacheStoreError):
            await host.feed.confirmed(sequence)  # the gateways' copies are gone, as it says
            raise NotDeleted(str(exc)) from exc
        raise
    unindex(host, ids, scope)
    # Answered once every gateway watching has dropped its copies (or been cut off and
    # stopped serving them): a gateway served the entry after the call had returned.
    await host.feed.confirmed(host.feed.publish(event, awaited=True))
    try:
        await share(host, event)
    except CacheStoreError as exc:
        raise NotShared(
            f"deleted, but the other cache replicas were not told ({exc}); retry"
        ) from exc
    return removed


def apply_peer(host: InvalidationHost, event: Event) -> None:
    """Another replica's invalidation or eviction, applied as if it had come here. The peer
    deleted from Milvus before it logged the event; what this replica wrote since, or had
    pending (a failed write of it may have landed), is deleted again."""
    ids = list(event.entry_ids)
    s = event.scope
    scope = ScopeFilter(s.tenant, s.model, s.model_version) if event.HasField("scope") else None
    late = forget(host, ids, scope).dropped
    if host.peer_sync is not None:
        late += host.peer_sync.matching(ids, scope)
    host.writes.delete_again(late)
    host.feed.publish(event)


async def share(host: InvalidationHost, event: Event) -> None:
    """Tells the other replicas on the same Milvus server, where there are any."""
    if host.peers is not None:
        await host.io_call(host.peers.append, event)


class Forgotten(NamedTuple):
    dropped: list[str]  # the keys of the pending stores dropped
    # Of them, those the index did not hold: never in Milvus (an Invalidate right after a
    # store said it had removed nothing).
    unwritten: int


def forget(host: InvalidationHost, ids: list[str], scope: ScopeFilter | None) -> Forgotten:
    """Out of every tier this process answers from, before Milvus is touched."""
    dropped = host.writes.drop(ids, scope)
    index = host.index
    unwritten = sum(1 for key in dropped if index is None or key not in index)
    unindex(host, ids, scope)
    host.tombstones.bury(ids, scope, time.monotonic())
    return Forgotten(dropped, unwritten)


def forget_all(host: InvalidationHost) -> None:
    """Everything this process answers from, dropped and hidden (another replica's events
    may have been lost unread): lookups read Milvus, stores are fenced for the tombstones'
    time; pending stores are deleted again, as a failed write of them may have landed."""
    everything = ScopeFilter()
    host.writes.delete_again(forget(host, [], everything).dropped)
    host.feed.publish(Event(scope=common_pb2.Scope()))


def unindex(host: InvalidationHost, ids: list[str], scope: ScopeFilter | None) -> None:
    if host.index is None:
        return
    host.index.remove(ids)
    if scope is not None:
        host.index.remove_scope(scope)


def _scope_message(scope: ScopeFilter | None) -> common_pb2.Scope | None:
    if scope is None:
        return None
    return common_pb2.Scope(
        tenant=scope.tenant, model=scope.model, model_version=scope.model_version
    )
