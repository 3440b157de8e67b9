"""cache/writer.py's retry of invalidations whose Milvus delete failed: each is tried on its
own, so one whose delete keeps failing (a large scope timing out) does not hold the others
hidden and fenced behind it, and each that lands is told to the other replicas and buried
from then (a reviewer's snippet: the second of two was never tried).

Stand-ins: the store fails the delete of one chosen scope (a real Milvus cannot be made to
fail one chosen delete while it takes the others); the tombstones are the real ones."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from hopline.cache.store import CacheStoreError, ScopeFilter
from hopline.cache.tombstones import Tombstones
from hopline.cache.writer import LateInvalidation, PendingWrites
from hopline.protos.hopline.cache.v1 import cache_pb2

KEEP_S = 1.0


class Store:
    def __init__(self) -> None:
        self.failing = {"big"}

    def delete(self, keys: Sequence[str]) -> int:
        return len(keys)

    def delete_scope(self, scope: ScopeFilter) -> int:
        if scope.tenant in self.failing:
            raise CacheStoreError("Milvus at http://m:19530: timed out after 5 s")
        if scope.tenant == "odd":  # an error of another kind: kept, not the writer's end
            raise ValueError("a filter Milvus refused")
        return 1


class Host:
    index = None
    peers = None
    peer_sync = None

    def __init__(self) -> None:
        self.tombstones = Tombstones(KEEP_S)
        self.store = Store()
        self.shared: list[str] = []

    def require_store(self) -> Store:
        return self.store

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    async def share(self, event: cache_pb2.WatchInvalidationsResponse) -> None:
        self.shared.append(event.scope.tenant)


def test_a_delete_that_keeps_failing_does_not_hold_the_others_behind_it() -> None:
    async def main() -> None:
        host = Host()
        writes = PendingWrites(host, 0.01)  # type: ignore[arg-type]  # the stand-in host
        for tenant in ("big", "odd", "small"):
            scope = ScopeFilter(tenant)
            host.tombstones.hold([], scope)
            event = cache_pb2.WatchInvalidationsResponse()
            event.scope.tenant = tenant
            writes.invalidate_later(LateInvalidation([], scope, event))
        assert await writes._delete_again() is not None  # big's and odd's failed
        assert writes.invalidations_pending() == 2
        assert host.shared == ["small"]
        later = time.monotonic() + KEEP_S + 0.1
        assert not host.tombstones.fences("k", ("small", "m", "1", "{}"), later)
        assert host.tombstones.fences("k", ("big", "m", "1", "{}"), later)  # still held
        host.store.failing.clear()
        assert await writes._delete_again() is not None  # odd's still fails, kept
        assert writes.invalidations_pending() == 1
        assert host.shared == ["small", "big"]

    asyncio.run(main())
