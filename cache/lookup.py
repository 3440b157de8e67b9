"""The cache's Lookup: the exact tier from memory, then the semantic tier.

The exact key (SHA-256 over scope and normalised text) is answered from the pending writes,
then the exact index; Milvus is read by key only where `reads_milvus` says so, beside the
encoder for a semantic lookup. A semantic lookup embeds the text (the vector is remembered,
so the store that follows a miss does not run the encoder again: `recall`), searches the
scope's live entries (cache/semantic_search.py) and accepts a candidate at the model's
threshold (cache/acceptance.py), or lets the verifier choose (cache/verifier.py).

`CacheLookup` works on the cache service's parts through `LookupHost` (cache/service.py is
the one host), as the write side (cache/writer.py) and the search (cache/semantic_search.py)
do through theirs.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hopline.cache.acceptance import accept, eligible
from hopline.cache.config import CacheConfig, ExactFallback
from hopline.cache.counts import CacheCount, CacheCounts
from hopline.cache.embedder import Embedder, Vector
from hopline.cache.exact_index import ExactIndex
from hopline.cache.keys import normalise_text, normalised_key
from hopline.cache.milvus_lite import is_local
from hopline.cache.peer_sync import PeerSync
from hopline.cache.semantic_search import SemanticSearch
from hopline.cache.shared_invalidations import SharedInvalidations
from hopline.cache.store import CacheStore, Entry
from hopline.cache.tombstones import Tombstones
from hopline.cache.verifier import Verifier
from hopline.cache.verify import VerifyPolicy
from hopline.cache.writer import PendingWrites
from hopline.model.repository import SENTENCE_EMBEDDING
from hopline.model.tokenizer import unseen
from hopline.observability import schema
from hopline.observability.tracing import child_span
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.tensors import to_tensor

RECENT_VECTORS = 4096  # 1.5 KiB each


class LookupHost(Protocol):
    """What a lookup uses of the cache service."""

    config: CacheConfig
    index: ExactIndex | None
    peers: SharedInvalidations | None
    peer_sync: PeerSync | None
    writes: PendingWrites
    tombstones: Tombstones
    counts: CacheCounts
    embedder: Embedder | None
    semantic: SemanticSearch
    verifier: Verifier

    def require_store(self) -> CacheStore: ...

    async def io_call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class CacheLookup:
    """One lookup's answer (`answer`): an exact or semantic hit, or a miss."""

    def __init__(self, host: LookupHost) -> None:
        self.host = host
        # Embeddings of recent semantic lookups: the store that follows a miss reuses the
        # lookup's vector instead of running the encoder a second time for the same text.
        self._recent: OrderedDict[str, Vector] = OrderedDict()

    async def answer(
        self,
        scope: tuple[str, str, str, str],
        text: str,
        semantic: bool,
        threshold: float,
        verify: VerifyPolicy | None = None,
    ) -> cache_pb2.LookupResponse:
        host = self.host
        store = host.require_store()
        now = time.time()
        t0 = time.perf_counter()
        normalised = normalise_text(text)
        key = normalised_key(scope, normalised)
        embedding: asyncio.Task[tuple[Vector, float]] | None = None
        # Where other replicas' invalidations went unread too long, memory may be stale.
        memory = host.peer_sync is None or host.peer_sync.current()
        with child_span(schema.SPAN_CACHE_EXACT):
            entry = host.writes.get(key) if memory else None
            if entry is None and memory and host.index is not None:
                entry = host.index.get(key, now)
                if entry is not None:
                    host.counts.add(CacheCount.INDEX_HITS)
            if entry is None and self.reads_milvus(semantic):
                if semantic:
                    # The embedding does not depend on the exact read: run both at once, so a
                    # miss pays max(read, embed) rather than their sum (a key query is ~2 ms).
                    embedding = asyncio.create_task(self._embed_timed(normalised))
                host.counts.add(CacheCount.EXACT_READS)
                try:
                    entry = self._unburied(await host.io_call(store.get, key, now))
                except BaseException:
                    if embedding is not None:
                        _detach(embedding)
                    raise
        response = cache_pb2.LookupResponse(exact_ms=(time.perf_counter() - t0) * 1e3)
        if entry is not None and entry.scope == scope and entry.expires_at > now:
            if embedding is not None:
                _detach(embedding)  # the encoder run is paid; its vector is still remembered
            host.counts.add(CacheCount.EXACT_HITS)
            return _hit(response, common_pb2.CACHE_OUTCOME_EXACT, entry, 1.0, now)
        if semantic:
            if embedding is None:
                embedding = asyncio.create_task(self._embed_timed(normalised))
            vector, response.embed_ms = await embedding
            # The caller may run the model's head on it rather than a second encoder run.
            response.query_embedding.CopyFrom(to_tensor(SENTENCE_EMBEDDING, vector[np.newaxis]))
            assert host.embedder is not None  # _embed_timed ran
            response.embedder = host.embedder.model.identity
            t2 = time.perf_counter()
            with child_span(schema.SPAN_CACHE_SEARCH) as span:
                searched = await host.semantic.search(vector, scope, now)
                found = [(e, similarity) for e, similarity in searched.found if self._unburied(e)]
                span.set_attribute(schema.CACHE_CANDIDATES, len(found))
                span.set_attribute(schema.CACHE_SEARCH_ROWS, searched.rows)
            response.search_ms = (time.perf_counter() - t2) * 1e3
            if verify is None:
                verdict = accept(
                    found,
                    scope,
                    now,
                    threshold,
                    host.config.agreement_margin,
                    normalised,
                    self._unseen,
                )
                host.counts.add(CacheCount.UNSEEN_MISMATCHES, verdict.unseen_mismatches)
                host.counts.add(CacheCount.AMBIGUOUS, int(verdict.ambiguous))
                hit = verdict.hit
            else:
                candidates, mismatches = eligible(found, scope, now, normalised, self._unseen)
                host.counts.add(CacheCount.UNSEEN_MISMATCHES, mismatches)
                hit, response.verify_id = host.verifier.serve(scope, candidates, verify)
            if hit is not None:
                host.counts.add(CacheCount.SEMANTIC_HITS)
                return _hit(response, common_pb2.CACHE_OUTCOME_SEMANTIC, *hit, now)
        host.counts.add(CacheCount.MISSES)
        response.outcome = common_pb2.CACHE_OUTCOME_MISS
        return response

    def _unburied(self, entry: Entry | None) -> Entry | None:
        """`entry` as read from Milvus, or None when it was deleted within tombstone_s."""
        if entry is not None and self.host.tombstones.hides(entry, time.monotonic()):
            self.host.counts.add(CacheCount.BURIED)
            return None
        return entry

    def reads_milvus(self, semantic: bool) -> bool:
        """Whether an exact lookup the memory could not answer reads Milvus by key."""
        host = self.host
        if host.index is None or host.peers is not None:
            # Over a shared server, another replica's stores are in Milvus, never in this
            # index: every index miss reads Milvus, whatever HOPLINE_CACHE_EXACT_FALLBACK says.
            return True
        fallback = host.config.exact_fallback
        if fallback is ExactFallback.ALL:
            return True
        # A milvus-lite file has one writer, this process, so the index holds all it wrote
        # but the index bound's drops, which the semantic search may still find (the same
        # text, cosine ~1.0). The read ran beside the encoder, on its cores (docs/cache.md).
        return fallback is ExactFallback.SEMANTIC and semantic and not is_local(host.config.uri)

    async def _embed_timed(self, text: str) -> tuple[Vector, float]:
        """The text's vector (remembered for the store a miss sends) and the ms it took."""
        embedder = self.host.embedder
        assert embedder is not None
        started = time.perf_counter()
        with child_span(schema.SPAN_CACHE_EMBED):
            vector = await embedder.embed(text)
        self._remember(text, vector)
        return vector, (time.perf_counter() - started) * 1e3

    def _unseen(self, normalised: str) -> tuple[str, ...]:
        assert self.host.embedder is not None
        return unseen(self.host.embedder.tokenizer, normalised)

    def _remember(self, text: str, vector: Vector) -> None:
        self._recent[text] = vector
        self._recent.move_to_end(text)
        while len(self._recent) > RECENT_VECTORS:
            self._recent.popitem(last=False)

    def recall(self, text: str) -> Vector | None:
        """The vector a lookup embedded for `text` (taken: a store reuses it once)."""
        return self._recent.pop(text, None)


def _hit(
    response: cache_pb2.LookupResponse,
    outcome: common_pb2.CacheOutcome.ValueType,
    entry: Entry,
    similarity: float,
    now: float,
) -> cache_pb2.LookupResponse:
    response.outcome = outcome
    response.prediction.ParseFromString(entry.response)
    response.similarity = min(1.0, similarity)
    response.entry_id = entry.key
    response.age_s = max(0.0, now - entry.created_at)
    return response


def _detach(task: asyncio.Task[Any]) -> None:
    """Let a task run on unawaited without an unretrieved-exception warning."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
