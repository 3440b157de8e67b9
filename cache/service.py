"""hopline.cache.v1.CacheService on grpc.aio: exact tier, then semantic tier, on Milvus.

Lookup (cache/lookup.py): the exact key (SHA-256 over scope and normalised text) first, with
no embedding, answered from memory (the pending buffer, then the exact index; Milvus only on
an index miss where HOPLINE_CACHE_EXACT_FALLBACK says so); then, when the model's policy is
semantic, the MiniLM embedding searched in the scope's live entries (cache/semantic_search.py),
accepted at the model's threshold.
Store: the entry is visible to the exact tier at once (a pending buffer) and written to
Milvus in batches by one writer task, which also enforces each (tenant, model)'s entry
bound, oldest first, and puts written entries into the exact index (cache/writer.py); a
store is checked and taken in cache/intake.py.
Invalidate (cache/invalidation.py): out of every tier in memory, then out of Milvus, then told
to the gateways' watches and to other replicas on the same Milvus server.
Start-up rebuilds the index from Milvus before the service reports SERVING.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from opentelemetry import trace

from hopline.cache import intake, invalidation
from hopline.cache.config import CacheConfig
from hopline.cache.counts import CacheCount, CacheCounts
from hopline.cache.embedder import Embedder, EmbeddingModel, Vector, embedding_model
from hopline.cache.entry_bounds import COUNT_REFRESH_S, EntryBounds, total_bound_problem
from hopline.cache.evidence import EvidenceLog
from hopline.cache.exact_index import ExactIndex
from hopline.cache.keys import ScopeError, scope_tuple
from hopline.cache.lookup import CacheLookup
from hopline.cache.milvus_access import MilvusAccess
from hopline.cache.milvus_lite import is_local
from hopline.cache.milvus_rows import MAX_TEXT_BYTES, row_problem
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.peer_sync import PeerSync, guard_memory
from hopline.cache.semantic_search import SemanticSearch
from hopline.cache.shared_evidence import SharedEvidence
from hopline.cache.shared_invalidations import KEEP_S, SKEW_S, SharedInvalidations, follow
from hopline.cache.store import CacheSettingError, CacheStore, CacheStoreError, ScopeFilter
from hopline.cache.tombstones import Tombstones
from hopline.cache.vector_index import (
    VectorIndex,
    one_blas_thread,
)
from hopline.cache.verifier import Verifier, policy_of
from hopline.cache.verify_ids import BadVerifyId, UnknownVerifyId
from hopline.cache.watch_feed import WatchFeed
from hopline.cache.writer import WRITE_ROWS, PendingWrites
from hopline.model.repository import is_version
from hopline.observability import schema
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.runtime.batching import QueueFullError
from hopline.runtime.errors import clip, status_code
from hopline.runtime.fairness import FLOW

log = logging.getLogger("hopline.cache")
# The counts GetStatsResponse has a field for, by the field's name.
STATS_COUNTS = tuple(
    count
    for count in CacheCount
    if count.value in cache_pb2.GetStatsResponse.DESCRIPTOR.fields_by_name
)

# Milvus calls block: two threads so a batched write never stalls every lookup.
IO_THREADS = 2
RECLAIM_CHECK_S = 5.0  # how often the store is asked whether deleted rows need reclaiming
DRAIN_WRITES_S = 5.0  # how long a drain waits for accepted stores to reach Milvus
STORE_BATCH_MAX = 1024  # stores in one StoreBatch (cache.proto says so)


def _weights_dir() -> Path:
    from hopline.model.build import default_weights_dir

    return default_weights_dir()


class CacheService(cache_pb2_grpc.CacheServiceServicer):
    service_names = (cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name,)

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        # Exact key -> entry, mirroring what is in Milvus; None reads Milvus by key instead.
        self.index: ExactIndex | None = (
            ExactIndex(config.exact_index_max_entries) if config.exact_index else None
        )
        self.store: CacheStore | None = None
        self.peers: SharedInvalidations | None = None  # other replicas on one Milvus server
        self.peer_sync: PeerSync | None = None  # with peers: whether memory may answer
        # Deleted a moment ago: hidden from lookups' reads of Milvus, which may lag it.
        self.tombstones = Tombstones(config.tombstone_s)
        # Each (tenant, model)'s entry count between Milvus counts; on a milvus-lite file,
        # written by this cache alone, never counted again only because it is old.
        self.bounds = EntryBounds(math.inf if is_local(config.uri) else COUNT_REFRESH_S)
        self.embedder: Embedder | None = None
        self.verifier = Verifier()
        self.counts = CacheCounts()
        self.lookup_ms: deque[float] = deque(maxlen=10_000)
        # Accepted stores not yet in Milvus; the exact tier reads them so a repeat hits at once.
        self.writes = PendingWrites(self, config.flush_interval_ms / 1e3, config.max_total_entries)
        self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="milvus")
        # The semantic tier's search, in memory or in Milvus (cache/semantic_search.py).
        self.semantic = SemanticSearch(
            self, milvus_in_flight=IO_THREADS, max_rows=config.search_batch_rows
        )
        self.lookups = CacheLookup(self)  # Lookup's exact and semantic tiers (cache/lookup.py)
        self._tasks: list[asyncio.Task[None]] = []
        self._blas: object = None  # numpy's BLAS limited to one thread while this is held
        self.placeholder: Vector = np.zeros(1, dtype=np.float32)  # sized at start
        self.feed = WatchFeed()  # WatchInvalidations' streams
        self._ready = False  # start() is done: the index holds every live entry

    def register(self, server: grpc.aio.Server) -> None:
        cache_pb2_grpc.add_CacheServiceServicer_to_server(self, server)

    async def start(self) -> None:
        access = MilvusAccess.of(self.config)  # first: a wrong setting fails with its name
        if problem := total_bound_problem(
            self.config.max_total_entries,
            local=is_local(self.config.uri),
            index_room=self.index.max_entries if self.index is not None else None,
            batch=WRITE_ROWS,
        ):
            raise CacheSettingError(problem)
        if (
            not is_local(self.config.uri)  # a milvus-lite file has no peers to poll
            and self.config.peer_poll_ms > 0
            and self.config.peer_stale_s * 1e3 <= 2 * self.config.peer_poll_ms
        ):
            raise CacheSettingError(
                f"HOPLINE_CACHE_PEER_STALE_S={self.config.peer_stale_s:g} must exceed two polls "
                f"of HOPLINE_CACHE_PEER_POLL_MS={self.config.peer_poll_ms:g}: memory would stop "
                "answering between polls"
            )
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(None, embedding_model, _weights_dir())
        self.embedder, self.store = await self._open(model, access)
        self.placeholder = np.zeros(model.dim, dtype=np.float32)
        self.placeholder[0] = 1.0
        entries = await self.io_call(self.store.count)
        log.info(
            "cache store open",
            extra={"uri": self.config.uri, "collection": model.collection, "entries": entries},
        )
        if not is_local(self.config.uri) and self.config.peer_poll_ms > 0:
            # Before the rebuild: its first read reaches back past it (SKEW_S).
            self.peer_sync = PeerSync(
                self.config.peer_stale_s,
                # A peer's delete precedes its event by its deletes and the append at most.
                margin_s=3 * self.config.milvus_timeout_s,
                history_s=KEEP_S - SKEW_S,
            )
            self.peers = await self.io_call(
                SharedInvalidations,
                self.config.uri,
                model.collection,
                self.config.milvus_timeout_s,
                access,
            )
        if self.index is not None:
            if self.config.semantic_index and is_local(self.config.uri):
                # A milvus-lite file has one writer, this process: memory can hold its scopes
                # whole. A Milvus server may have other replicas writing to it.
                self.index.vectors = VectorIndex(model.dim, self.config.semantic_index_max_rows)
                self._blas = one_blas_thread()
            await self._rebuild_index(self.index, self.store)
        if is_local(self.config.uri):
            state = self.config.verify_state_path()
            await self.verifier.start(lambda: EvidenceLog(state), str(state))
        else:
            await self.verifier.start(
                lambda: SharedEvidence(
                    self.config.uri, model.collection, self.config.milvus_timeout_s, access
                ),
                f"{model.collection}_evidence",
            )
        self._tasks = [
            asyncio.create_task(self._sweep(), name="sweep"),
            asyncio.create_task(self.writes.run(), name="writer"),
            asyncio.create_task(self._reclaim(), name="reclaim"),
            asyncio.create_task(self.verifier.keep_keys(), name="verify-keys"),
        ]
        if self.peers is not None:
            poll_s = self.config.peer_poll_ms / 1e3
            assert self.peer_sync is not None  # made with the peers
            # The index rebuilt from Milvus is as current as a poll would make it, and the
            # first poll reads back past the rebuild (SKEW_S).
            self.peer_sync.read_at = time.monotonic()
            follower = follow(
                self.peers,
                self.io_call,
                lambda event: invalidation.apply_peer(self, event),
                self.peer_sync,
                self._start_over,
                poll_s,
            )
            self._tasks.append(asyncio.create_task(follower, name="peers"))
            guard = guard_memory(self.peer_sync, self.feed, poll_s)
            self._tasks.append(asyncio.create_task(guard, name="peer-guard"))
            evidence = self.verifier.follow(poll_s)
            self._tasks.append(asyncio.create_task(evidence, name="peer-evidence"))
        self._ready = True

    async def _open(
        self, model: EmbeddingModel, access: MilvusAccess
    ) -> tuple[Embedder, MilvusStore]:
        """The embedder and the store, opened side by side: neither needs the other (the
        collection is named from the weights' digest, not the session), and one after the
        other they were most of a start (on the 2-core VM, a new database: the embedder's
        sessions 0.9-1.6 s, pymilvus's import, milvus-lite's server and the collection 1.0 s;
        both 2.1-2.6 s one after the other, 1.1 s side by side). One that fails closes the
        other."""
        loop = asyncio.get_running_loop()
        config = self.config
        loading = loop.run_in_executor(
            None,
            lambda: Embedder.load(
                _weights_dir(),
                Path(config.work_dir),
                threads=config.embed_threads,
                workers=config.embed_workers,
                spin=config.embed_spin,
                model=model,
            ),
        )
        opening = loop.run_in_executor(
            self._io,
            lambda: MilvusStore(
                config.uri,
                model.collection,
                model.dim,
                index_type=config.index_type,
                timeout_s=config.milvus_timeout_s,
                load_timeout_s=config.load_timeout_s,
                reclaim_ratio=config.reclaim_ratio,
                lookup_consistency=config.lookup_consistency,
                access=access,
            ),
        )
        embedder, store = await asyncio.gather(loading, opening, return_exceptions=True)
        if isinstance(embedder, Embedder) and isinstance(store, MilvusStore):
            return embedder, store
        if isinstance(embedder, Embedder):
            await embedder.close()
        if isinstance(store, MilvusStore):
            await loop.run_in_executor(self._io, store.close)
        raise next(r for r in (embedder, store) if isinstance(r, BaseException))

    async def _rebuild_index(self, index: ExactIndex, store: CacheStore) -> None:
        """Every live entry's scalar fields, read in pages, before the service is SERVING."""
        started = time.perf_counter()
        now = time.time()
        live = await self.io_call(store.live, now)
        self.counts.add(CacheCount.INDEX_REBUILT, index.load(live, now))
        log.info(
            "exact index rebuilt",
            extra={
                "entries": len(index),
                "read": len(live),
                "seconds": round(time.perf_counter() - started, 3),
            },
        )

    async def drain(self) -> None:
        """End the watch streams, so held-open streams do not take the drain's whole grace."""
        self.feed.end_all()

    async def stop(self) -> None:
        if self.store is not None:
            await self.writes.drain(DRAIN_WRITES_S)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.semantic.stop()
        await self.verifier.stop()
        if self.embedder is not None:
            await self.embedder.close()
        if self.store is not None:
            store, self.store = self.store, None
            await asyncio.get_running_loop().run_in_executor(self._io, store.close)
        if self.peers is not None:
            await asyncio.get_running_loop().run_in_executor(self._io, self.peers.close)
        self._io.shutdown(wait=True)

    async def io_call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def require_store(self) -> CacheStore:
        if self.store is None:
            raise CacheStoreError("the cache store is not open")
        return self.store

    # -- background work ------------------------------------------------------------------

    def _start_over(self, gap_s: float) -> None:
        """The peers' log went unread longer than it keeps events: some may be gone unread,
        so nothing in memory can be trusted (every gateway's watch ended with the outage)."""
        log.warning(
            "the other replicas' invalidations went unread longer than their log keeps them: "
            "memory emptied, lookups read Milvus",
            extra={"unread_s": round(gap_s, 1)},
        )
        invalidation.forget_all(self)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            if self.index is not None:
                # Lookups already skip them; this frees memory, and tells the key listings.
                self.feed.let_go(self.index.expire(time.time()))
            try:
                expired = await self.io_call(self.require_store().expire, time.time())
                self.counts.add(CacheCount.EXPIRATIONS, expired)
            except CacheStoreError as exc:
                log.warning("expiry sweep failed", extra={"error": str(exc)})

    async def _reclaim(self) -> None:
        """milvus-lite's deleted rows, freed by copying the live ones (cache/generations.py)."""
        while True:
            await asyncio.sleep(RECLAIM_CHECK_S)
            try:
                done = await self.io_call(self.require_store().reclaim, time.time())
            except CacheStoreError as exc:
                log.warning("reclaiming deleted rows failed", extra={"error": str(exc)})
                continue
            if done is not None:
                self.counts.add(CacheCount.RECLAIMS)
                log.info(
                    "reclaimed deleted rows",
                    extra={
                        "collection": done.collection,
                        "copied": done.copied,
                        "freed": done.freed,
                        "replayed": done.replayed,
                        "seconds": round(done.seconds, 3),
                        "switch_ms": round(done.switch_ms, 1),
                    },
                )

    # -- RPCs -----------------------------------------------------------------------------

    async def Lookup(
        self,
        request: cache_pb2.LookupRequest,
        context: grpc.aio.ServicerContext[cache_pb2.LookupRequest, cache_pb2.LookupResponse],
    ) -> cache_pb2.LookupResponse:
        started = time.perf_counter()
        try:
            scope = scope_tuple(request.scope)
        except ScopeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.mode not in intake.MODES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"mode must be 'exact' or 'semantic', got {clip(request.mode)!r}",
            )
        if not request.text.strip():
            # As Store refuses it; a semantic lookup would have run the encoder on nothing.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "text is empty: nothing to look up"
            )
        if problem := row_problem(scope, "", b""):
            # No entry can have such a scope (Store refuses it the same way).
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if len(request.text.encode("utf-8")) > MAX_TEXT_BYTES:
            # No entry can hold it, and a semantic lookup would tokenize all of it.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"text is over {MAX_TEXT_BYTES} bytes, more than any cache entry holds",
            )
        semantic = request.mode == "semantic"
        if semantic and not 0.0 < request.threshold <= 1.0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a semantic lookup needs 0 < threshold <= 1, got {request.threshold}",
            )
        try:
            verify = policy_of(request) if semantic else None
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        flow = FLOW.set(scope[0])  # the embedder's fair share (runtime/fairness.py)
        try:
            response = await self.lookups.answer(
                scope, request.text, semantic, request.threshold, verify
            )
        except CacheStoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"embedder overloaded: {exc}")
        finally:
            FLOW.reset(flow)
        self.counts.add(CacheCount.LOOKUPS)
        self.lookup_ms.append((time.perf_counter() - started) * 1e3)
        return response

    async def Store(
        self,
        request: cache_pb2.StoreRequest,
        context: grpc.aio.ServicerContext[cache_pb2.StoreRequest, cache_pb2.StoreResponse],
    ) -> cache_pb2.StoreResponse:
        result = await intake.take(self, request)
        if result.code:
            await context.abort(status_code(result.code), result.message)
        return cache_pb2.StoreResponse(entry_id=result.entry_id)

    async def StoreBatch(
        self,
        request: cache_pb2.StoreBatchRequest,
        context: grpc.aio.ServicerContext[
            cache_pb2.StoreBatchRequest, cache_pb2.StoreBatchResponse
        ],
    ) -> cache_pb2.StoreBatchResponse:
        if len(request.stores) > STORE_BATCH_MAX:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.stores)} stores in one call; send at most {STORE_BATCH_MAX}",
            )
        # Together: semantic stores' embeddings share the encoder's batches.
        results = await asyncio.gather(*(intake.take(self, store) for store in request.stores))
        return cache_pb2.StoreBatchResponse(results=results)

    async def Invalidate(
        self,
        request: cache_pb2.InvalidateRequest,
        context: grpc.aio.ServicerContext[
            cache_pb2.InvalidateRequest, cache_pb2.InvalidateResponse
        ],
    ) -> cache_pb2.InvalidateResponse:
        scope = None
        if request.HasField("scope"):
            s = request.scope
            if s.parameters:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "Invalidate matches a scope's tenant, model and model_version, not its "
                    "parameters: leave scope.parameters empty (every entry of the version goes) "
                    "or name the entries by entry_ids",
                )
            scope = ScopeFilter(s.tenant, s.model, s.model_version)
            if scope.is_empty():
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "an empty scope would drop every tenant's entries; name a tenant or model",
                )
            if scope.model_version and not scope.model:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "a model_version needs its model"
                )
            if scope.model_version and not is_version(scope.model_version):
                # It matches nothing ever stored: "0 removed" read as done (a model author's
                # probe, `hopline cache invalidate --model-version 0`).
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "model_version is a version number, a positive integer as the model "
                    "repository's folders are named (1, 2, ...), got "
                    f"{clip(scope.model_version)!r}",
                )
        if scope is None and not request.entry_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a scope or entry_ids")
        ids = list(request.entry_ids)
        bad = [i for i in ids if len(i) != 64 or i.strip("0123456789abcdef")]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(bad)} not cache entry ids (64 hex digits), such as {clip(bad[0])!r}",
            )
        try:
            removed = await invalidation.invalidate(self, ids, scope)
        except invalidation.NotShared as exc:  # its message says what was done
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except invalidation.NotDeleted as exc:
            # Said whole: "UNAVAILABLE: <Milvus's error>" read as done but for a detail.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"not invalidated in Milvus yet: its delete failed ({exc}); the entries are "
                "hidden from this cache's lookups and dropped by the gateways, and the cache "
                "deletes them once Milvus answers (pending_invalidations in `hopline cache "
                "stats`), but a restart of it before then serves them again: retry once "
                "Milvus answers to be sure",
            )
        return cache_pb2.InvalidateResponse(removed=removed)

    async def share(self, event: cache_pb2.WatchInvalidationsResponse) -> None:
        await invalidation.share(self, event)

    async def WatchInvalidations(
        self,
        request: cache_pb2.WatchInvalidationsRequest,
        context: grpc.aio.ServicerContext[
            cache_pb2.WatchInvalidationsRequest, cache_pb2.WatchInvalidationsResponse
        ],
    ) -> AsyncIterator[cache_pb2.WatchInvalidationsResponse]:
        if self.peer_sync is not None and not self.peer_sync.current():
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "this cache replica cannot read the other replicas' invalidations (Milvus does "
                "not answer): what it holds may be stale; retry the watch",
            )
        listing = None
        if request.keys and self._lists_keys():
            if not self._ready:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "the cache is still loading its exact index; retry the watch",
                )
            listing = self._held_keys()
        # Confirmations only where this cache is its store's one replica (see the proto).
        acks = request.acks and is_local(self.config.uri)
        async for event in self.feed.stream(listing, request.heartbeats, acks):
            yield event

    async def AckInvalidations(
        self,
        request: cache_pb2.AckInvalidationsRequest,
        context: grpc.aio.ServicerContext[
            cache_pb2.AckInvalidationsRequest, cache_pb2.AckInvalidationsResponse
        ],
    ) -> cache_pb2.AckInvalidationsResponse:
        self.feed.ack(request.watch_id, request.sequence)
        return cache_pb2.AckInvalidationsResponse()

    def _lists_keys(self) -> bool:
        """Whether this cache's exact keys decide its exact-only lookups: memory answers them
        alone, so a key it does not list is a miss (see WatchInvalidationsRequest.keys). Only
        on milvus-lite, one process per file: over a Milvus server another replica may take
        stores this one never hears of."""
        return (
            is_local(self.config.uri)
            and self.index is not None
            and not self.lookups.reads_milvus(semantic=False)
        )

    def _held_keys(self) -> list[tuple[str, tuple[str, str, str, str]]]:
        assert self.index is not None
        return self.writes.held() + self.index.held()

    async def ReportVerification(
        self,
        request: cache_pb2.ReportVerificationRequest,
        context: grpc.aio.ServicerContext[
            cache_pb2.ReportVerificationRequest, cache_pb2.ReportVerificationResponse
        ],
    ) -> cache_pb2.ReportVerificationResponse:
        if not request.prediction.label:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "report the model's prediction, with its label"
            )
        try:
            agreed = await self.verifier.report(request.verify_id, request.prediction)
        except UnknownVerifyId as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except BadVerifyId as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CacheStoreError as exc:  # the signing keys could not be read again
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"verify_id's key: {exc}")
        trace.get_current_span().set_attribute(schema.CACHE_VERIFY_AGREED, agreed)
        return cache_pb2.ReportVerificationResponse(agreed=agreed)

    async def GetStats(
        self,
        request: cache_pb2.GetStatsRequest,
        context: grpc.aio.ServicerContext[cache_pb2.GetStatsRequest, cache_pb2.GetStatsResponse],
    ) -> cache_pb2.GetStatsResponse:
        unreachable = False
        try:
            entries = await self.io_call(self.require_store().count)
        except CacheStoreError:
            # The outage is when pending_writes, write_retries and store_errors matter most:
            # answered, not UNAVAILABLE.
            entries, unreachable = (len(self.index) if self.index is not None else 0), True
        times = np.array(self.lookup_ms or [0.0])
        return cache_pb2.GetStatsResponse(
            entries=entries,
            milvus_unreachable=unreachable,
            **{count.value: self.counts[count] for count in STATS_COUNTS},
            lookup_mean_ms=float(times.mean()),
            lookup_p50_ms=float(np.percentile(times, 50)),
            lookup_p99_ms=float(np.percentile(times, 99)),
            pending_writes=self.writes.in_flight(),
            pending_invalidations=self.writes.invalidations_pending(),
            uri=self.config.uri,
            collection=self.embedder.model.collection if self.embedder else "",
            verify_candidates=self.verifier.counts["candidates"],
            verified=self.verifier.counts["verified"],
            disagreements=self.verifier.counts["disagreements"],
            verified_after_reply=self.verifier.counts["after_reply"],
            verify_rules=self.verifier.rules_for_stats(),
        )
