"""The semantic tier's search: a lookup's vector against the scope's live entries.

From memory while the cache process holds the scope whole (cache/vector_index.py: a
milvus-lite file has one writer, this process), else from Milvus, reading the scope's
vectors back into memory meanwhile when a restart left them out. Either way, searches of one
scope that wait at the same moment share one call (cache/search_batching.py).

`SemanticSearch` works on the cache service's parts through `SearchHost` (cache/service.py is
the one host), as the write side does through cache/writer.py's `WriteHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from opentelemetry import trace

from hopline.cache.counts import CacheCount, CacheCounts
from hopline.cache.embedder import Vector
from hopline.cache.exact_index import ExactIndex
from hopline.cache.search_batching import SearchBatcher, Searched
from hopline.cache.store import CacheStore, CacheStoreError, Entry, Scope
from hopline.cache.vector_index import INLINE_ROWS, SearchIn, nearest
from hopline.observability import schema
from hopline.observability.logs import Episodes

log = logging.getLogger("hopline.cache")
# With Milvus away, each lookup of a scope not yet read tries its read again: said once an
# episode, not once a lookup.
READ_FAILURES = Episodes(log, "reading a scope's vectors failed")
VECTOR_READS = "vector reads"

SEMANTIC_CANDIDATES = 4  # nearest entries checked for verification and agreement


class SearchHost(Protocol):
    """What the semantic search uses of the cache service."""

    index: ExactIndex | None
    counts: CacheCounts
    placeholder: Vector  # an exact-only entry's vector: never read back into memory

    def require_store(self) -> CacheStore: ...

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class SemanticSearch:
    """A lookup's nearest live entries (`search`), in memory or in Milvus."""

    def __init__(self, host: SearchHost, *, milvus_in_flight: int, max_rows: int) -> None:
        self.host = host
        # Milvus calls run on the host's I/O threads: as many in flight as there are threads.
        self.milvus = SearchBatcher(
            self._search_milvus, max_in_flight=milvus_in_flight, max_rows=max_rows
        )
        # Scopes searched in memory: one product for the searches that waited.
        self.memory = SearchBatcher(self._search_memory, max_in_flight=1, max_rows=max_rows)
        self._reading: set[Scope] = set()  # scopes whose vectors are being read back
        self._readers: set[asyncio.Task[None]] = set()  # those reads (held: weak otherwise)

    async def search(self, vector: Vector, scope: Scope, now: float) -> Searched:
        """The scope's nearest live entries to `vector`, at most SEMANTIC_CANDIDATES."""
        counts = self.host.counts
        index = self.host.index
        vectors = index.vectors if index is not None else None
        span = trace.get_current_span()
        if vectors is not None and vectors.holds_whole(scope):
            counts.add(CacheCount.MEMORY_SEARCHES)
            span.set_attribute(schema.CACHE_SEARCH_IN, SearchIn.MEMORY.value)
            return await self.memory.search(vector, scope, now, SEMANTIC_CANDIDATES)
        if vectors is not None and vectors.needs_reading(scope):
            self._read_back(scope)
        counts.add(CacheCount.MILVUS_SEARCHES)
        span.set_attribute(schema.CACHE_SEARCH_IN, SearchIn.MILVUS.value)
        return await self.milvus.search(vector, scope, now, SEMANTIC_CANDIDATES)

    async def stop(self) -> None:
        """Cancels the read-backs still going."""
        for task in list(self._readers):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _search_milvus(
        self, vectors: Sequence[Vector], scope: Scope, now: float, limit: int
    ) -> list[list[tuple[Entry, float]]]:
        found: list[list[tuple[Entry, float]]] = await self.host.io_call(
            self.host.require_store().search, vectors, scope, now, limit
        )
        return found

    async def _search_memory(
        self, queries: Sequence[Vector], scope: Scope, now: float, limit: int
    ) -> list[list[tuple[Entry, float]]]:
        index = self.host.index
        assert index is not None
        assert index.vectors is not None
        snapshot = index.vectors.snapshot(scope)
        if snapshot is None:
            return [[] for _ in queries]
        units = [q / max(float(np.linalg.norm(q)), 1e-12) for q in queries]
        if snapshot[3] * len(units) <= INLINE_ROWS:
            matches = nearest(snapshot, units, limit)
        else:  # numpy lets go of the GIL: the loop goes on serving meanwhile
            matches = await asyncio.to_thread(nearest, snapshot, units, limit)
        # Through the exact index: an entry removed or expired meanwhile is not returned.
        return [
            [(e, sim) for key, sim in found if (e := index.get(key, now)) is not None]
            for found in matches
        ]

    def _read_back(self, scope: Scope) -> None:
        """Starts reading `scope`'s vectors from Milvus into memory, once at a time."""
        if scope in self._reading:
            return
        self._reading.add(scope)

        async def read() -> None:
            host = self.host
            try:
                rows = await host.io_call(host.require_store().vectors_of, scope, time.time())
                index = host.index
                if index is not None and index.vectors is not None:
                    semantic = [
                        (key, v) for key, v in rows if not np.array_equal(v, host.placeholder)
                    ]
                    host.counts.add(
                        CacheCount.VECTORS_READ, index.vectors.absorb(scope, semantic, index)
                    )
                READ_FAILURES.ended(VECTOR_READS)
            except CacheStoreError as exc:  # the next lookup of the scope tries again
                READ_FAILURES.failed(VECTOR_READS, type(exc).__name__, error=str(exc))
            finally:
                self._reading.discard(scope)

        task = asyncio.create_task(read(), name="read-vectors")
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)
