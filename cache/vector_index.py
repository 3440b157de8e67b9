"""The semantic tier's in-memory search: each scope's vectors in one matrix, searched with one
matrix-vector product instead of a Milvus call.

On milvus-lite a search is a pymilvus call over gRPC to its server and a filtered flat scan
there: about 2.1 ms p50 at concurrency 1 over 1,500 entries (a co-located mesh's semantic
miss is 9 ms, its model 3.7), where the product over a few thousand 384-d rows takes tens of
microseconds. Used over a milvus-lite file only, whose one writer is the cache service (over a
Milvus server other replicas write too). Milvus stays the durable store and the search of
record; this mirrors the vectors of the entries the exact index holds (cache/exact_index.py
keeps it in step on every put, replacement, removal, expiry and drop), and a scope is searched
here only while it holds the scope whole:

- a scope that had entries when the service started is not whole until its vectors are read
  back from Milvus (`absorb`, which the scope's first semantic lookup starts; lookups before
  it ends search Milvus);
- a scope one of whose entries the exact index let go for room (Milvus keeps it), or one that
  would take the mirror past `max_rows`, is searched in Milvus until the next start.

Exact-only entries (the placeholder vector) are not held. What a search returns is resolved
through the exact index, so an entry removed meanwhile is never returned.

Rows are appended and a removed row is only marked dead, so row numbers hold still while a
large scope is searched on a worker thread; the scope's arrays are rebuilt (new arrays, the
old ones left to any search still reading them) once the dead outnumber the living.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Container, Iterable, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

from hopline.cache.embedder import Vector
from hopline.cache.store import Scope

COMPACT_MIN_DEAD = 256  # dead rows a scope carries before compaction is worth a copy
# Scopes with more rows than this are searched on a worker thread, not the event loop: one
# search 5 ms after the last reads its matrix from memory, 0.87 ms over 6,000 rows and 3.0 ms
# over 20,000 on the 2-core VM (one BLAS thread), and the loop should not stall that long.
INLINE_ROWS = 4096
Match = tuple[str, float]  # an entry's key and its cosine similarity to the query
# A scope's arrays as a search reads them: vectors, mask, keys by row, rows in use.
Snapshot = tuple[np.ndarray, np.ndarray, list[str | None], int]


def one_blas_thread() -> object:
    """Limits numpy's BLAS to one thread in this process; keep the returned object.

    OpenBLAS spreads a product this size over every core and then spins its threads for a
    few milliseconds after each call: a search over 6,000 rows every 5 ms cost 6.4 ms of CPU
    for 0.63 ms of wall time, against 0.91 for 0.87 on one thread (measured), and that CPU
    is taken from the encoder on the same cores (co-located mesh at 32 callers: the cache
    process 11.5-14.1 ms of CPU a lookup against 8.3-8.7 with its searches in Milvus).
    """
    return threadpool_limits(limits=1, user_api="blas")


class SearchIn(enum.StrEnum):
    """Where a semantic search ran (the `cache.search` span's `hopline.cache.search_in`)."""

    MEMORY = "memory"
    MILVUS = "milvus"


class _Block:
    """One scope's vectors: rows appended, dead rows masked by `-inf`, keys by row."""

    def __init__(self, dim: int) -> None:
        self.vectors = np.zeros((64, dim), np.float32)
        self.mask = np.zeros(64, np.float32)  # 0 for a live row, -inf for a dead one
        self.keys: list[str | None] = []
        self.rows: dict[str, int] = {}
        self.dead = 0

    def add(self, key: str, vector: Vector) -> None:
        n = len(self.keys)
        if n == len(self.vectors):
            self._resize(2 * n)
        self.vectors[n] = vector
        self.mask[n] = 0.0
        self.keys.append(key)
        self.rows[key] = n

    def kill(self, key: str) -> bool:
        row = self.rows.pop(key, None)
        if row is None:
            return False
        self.keys[row] = None
        self.mask[row] = -np.inf
        self.dead += 1
        if self.dead > max(COMPACT_MIN_DEAD, len(self.rows)):
            self._compact()
        return True

    def _resize(self, capacity: int) -> None:
        # New arrays: a search on a worker thread keeps reading the ones it was given.
        n = len(self.keys)
        vectors = np.zeros((capacity, self.vectors.shape[1]), np.float32)
        vectors[:n] = self.vectors[:n]
        mask = np.full(capacity, -np.inf, np.float32)
        mask[:n] = self.mask[:n]
        self.vectors, self.mask = vectors, mask

    def _compact(self) -> None:
        live = [row for row, key in enumerate(self.keys) if key is not None]
        capacity = max(64, 2 * len(live))
        vectors = np.zeros((capacity, self.vectors.shape[1]), np.float32)
        vectors[: len(live)] = self.vectors[live]
        self.vectors, self.mask = vectors, np.zeros(capacity, np.float32)
        self.keys = [self.keys[row] for row in live]
        self.rows = {key: row for row, key in enumerate(self.keys) if key is not None}
        self.dead = 0

    def snapshot(self) -> Snapshot:
        return self.vectors, self.mask, self.keys, len(self.keys)


def nearest(snapshot: Snapshot, queries: Sequence[Vector], limit: int) -> list[list[Match]]:
    """For each query (a unit vector), the `limit` live rows most similar to it (cosine),
    nearest first. Several queries are one matrix product: the matrix is read once for them
    all. Safe on a worker thread: it reads only the arrays it is given."""
    vectors, mask, keys, n = snapshot
    if n == 0 or limit < 1:
        return [[] for _ in queries]
    similarity = vectors[:n] @ np.stack(queries, axis=1) + mask[:n, np.newaxis]
    k = min(limit, n)
    found = []
    for column in similarity.T:
        top = np.argpartition(-column, k - 1)[:k] if k < n else np.arange(n)
        top = top[np.argsort(-column[top], kind="stable")]
        found.append(
            [
                (key, float(column[row]))
                for row in top
                if (key := keys[row]) is not None and np.isfinite(column[row])
            ]
        )
    return found


class VectorIndex:
    """Unit vectors of semantic entries, by scope, for the scopes held whole."""

    def __init__(self, dim: int, max_rows: int) -> None:
        self.dim = dim
        self.max_rows = max_rows
        self._blocks: dict[Scope, _Block] = {}
        self._scope_of: dict[str, Scope] = {}
        self._unread: set[Scope] = set()  # had entries at start; vectors not read back yet
        self._lost: set[Scope] = set()  # an entry left for room: searched in Milvus for good

    def __len__(self) -> int:
        return len(self._scope_of)

    def holds_whole(self, scope: Scope) -> bool:
        return scope not in self._unread and scope not in self._lost

    def needs_reading(self, scope: Scope) -> bool:
        return scope in self._unread and scope not in self._lost

    def put(self, key: str, scope: Scope, vector: Vector) -> None:
        self.remove(key)
        if scope in self._lost:
            return
        if len(self._scope_of) >= self.max_rows:
            self.lose(scope)
            return
        norm = float(np.linalg.norm(vector)) if vector.shape == (self.dim,) else 0.0
        if not (math.isfinite(norm) and norm > 0.0):
            # Not a vector a search can compare (the encoder's are unit length): Milvus,
            # which holds the row as it was written, searches the scope from now on.
            self.lose(scope)
            return
        block = self._blocks.get(scope)
        if block is None:
            block = self._blocks[scope] = _Block(self.dim)
        block.add(key, vector / norm)
        self._scope_of[key] = scope

    def remove(self, key: str) -> None:
        scope = self._scope_of.pop(key, None)
        if scope is None:
            return
        block = self._blocks[scope]
        block.kill(key)
        if not block.rows:
            del self._blocks[scope]

    def lose(self, scope: Scope) -> None:
        """Some of `scope`'s entries are in Milvus only: search it there from now on."""
        self._lost.add(scope)
        block = self._blocks.pop(scope, None)
        if block is not None:
            for key in block.rows:
                del self._scope_of[key]

    def unread(self, scopes: Iterable[Scope]) -> None:
        """Scopes whose entries were rebuilt without their vectors (start-up)."""
        self._unread.update(scopes)

    def absorb(self, scope: Scope, rows: Iterable[tuple[str, Vector]], held: Container[str]) -> int:
        """The vectors read back from Milvus for `scope`: each row whose key the exact index
        holds (`held`) and this index does not already (a newer put wins) is added; then
        the scope is whole. Returns the rows added."""
        added = 0
        for key, vector in rows:
            if key in held and key not in self._scope_of and scope not in self._lost:
                self.put(key, scope, vector)
                added += 1
        self._unread.discard(scope)
        return added

    def snapshot(self, scope: Scope) -> tuple[np.ndarray, np.ndarray, list[str | None], int] | None:
        block = self._blocks.get(scope)
        return None if block is None else block.snapshot()
