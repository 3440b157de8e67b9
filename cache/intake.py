"""A store request checked and taken into the cache's pending writes (cache/writer.py), or
refused with the status Store ends with and StoreBatch reports per store.

Taken means visible to the exact tier at once: the writer puts it into Milvus later, in
batches. A semantic store's vector is the one its lookup computed where the lookup remembered
it (cache/lookup.py's `recall`); otherwise the encoder runs here.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import grpc
import numpy as np
from opentelemetry import trace

from hopline.cache.config import CacheConfig
from hopline.cache.counts import CacheCount, CacheCounts
from hopline.cache.embedder import Embedder, Vector
from hopline.cache.exact_index import ExactIndex
from hopline.cache.keys import ScopeError, normalise_text, normalised_key, scope_tuple
from hopline.cache.lookup import CacheLookup
from hopline.cache.milvus_rows import row_problem
from hopline.cache.store import Entry
from hopline.cache.tombstones import Tombstones
from hopline.cache.watch_feed import WatchFeed
from hopline.cache.writer import PendingWrites
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.batching import QueueFullError
from hopline.runtime.errors import clip
from hopline.runtime.tensors import TensorError, dtype_name, from_tensor

MODES = ("", "exact", "semantic")  # cache.proto's mode strings; "" is the model's own


class IntakeHost(Protocol):
    """What taking a store uses of the cache service."""

    config: CacheConfig
    writes: PendingWrites
    lookups: CacheLookup
    feed: WatchFeed
    counts: CacheCounts
    embedder: Embedder | None
    placeholder: Vector  # an exact-only store's vector
    tombstones: Tombstones
    index: ExactIndex | None


async def take(host: IntakeHost, request: cache_pb2.StoreRequest) -> cache_pb2.StoreResult:
    """The store's entry id once taken, or its refusal's code and message."""
    try:
        scope = scope_tuple(request.scope)
    except ScopeError as exc:
        return refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if problem := _request_problem(request):
        return refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
    if len(host.writes) >= host.config.max_pending:
        return refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(host.writes)} stores are waiting for Milvus; retry later",
        )
    assert host.embedder is not None
    text = normalise_text(request.text)
    response = request.prediction.SerializeToString()
    if problem := row_problem(scope, text, response):
        # Refused here: Milvus would refuse the row, and with it its whole write.
        return refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
    key = normalised_key(scope, text)
    if host.tombstones.fences(key, scope, time.monotonic()):
        host.counts.add(CacheCount.STORES_FENCED)
        return refused(
            grpc.StatusCode.ABORTED,
            f"not stored: the entry was invalidated within the last "
            f"{host.tombstones.keep_s:g} s (HOPLINE_CACHE_TOMBSTONE_S), or by an invalidation "
            "whose Milvus delete has not landed yet, and an answer computed before that would "
            "be served again; a miss after that stores it",
        )
    vector = host.lookups.recall(text)
    if request.mode == "exact":
        # Never searched: the gateway looks exact-mode scopes up by key only. A unit
        # placeholder keeps the collection's schema; a direct semantic lookup on such a
        # scope compares against it and stays far below any threshold.
        vector = host.placeholder
    elif vector is None:
        try:
            vector = await host.embedder.embed(text)
        except QueueFullError as exc:
            return refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"embedder overloaded: {exc}; retry later"
            )
        host.counts.add(CacheCount.STORE_EMBEDDINGS)
    now = time.time()
    limit = min(request.max_entries or host.config.max_entries, host.config.max_entries)
    entry = Entry(
        key=key,
        scope=scope,
        text=text,
        response=response,
        created_at=now,
        expires_at=now + (request.ttl_s or host.config.default_ttl_s),
    )
    replaced = _current(host, key, now)
    host.writes.add(key, (entry, vector, limit), trace.get_current_span().get_span_context())
    if replaced is not None and not _same_answer(replaced.response, request.prediction):
        # Another answer for a key the cache holds (a REFRESH, or a store over an entry):
        # gateways keep the old one in their local tiers until an event drops it (another
        # gateway answered a REFRESHed text with the old answer until its TTL).
        host.feed.publish(cache_pb2.WatchInvalidationsResponse(entry_ids=[key]))
    host.feed.held(key, scope)
    host.counts.add(CacheCount.STORES)
    return cache_pb2.StoreResult(entry_id=key)


# Scores this close are the same answer: a text run in another batch (other padding) can
# differ in the last bits, and an event for that would make every gateway drop a right copy.
SAME_SCORE = 1e-4


def _same_answer(stored: bytes, new: common_pb2.Prediction) -> bool:
    old = common_pb2.Prediction.FromString(stored)
    if (old.label, old.out_of_scope) != (new.label, new.out_of_scope):
        return False
    if [s.label for s in old.top_k] != [s.label for s in new.top_k]:
        return False
    scores = zip(
        (old.score, *(s.score for s in old.top_k)),
        (new.score, *(s.score for s in new.top_k)),
        strict=True,
    )
    return all(abs(a - b) <= SAME_SCORE for a, b in scores)


def _current(host: IntakeHost, key: str, now: float) -> Entry | None:
    """The entry `key` names now: a pending store's, else the exact index's (None where the
    index is off: a store over an entry in Milvus alone is then not seen here)."""
    pending = host.writes.get(key)
    if pending is not None or host.index is None:
        return pending
    return host.index.get(key, now)


def _request_problem(request: cache_pb2.StoreRequest) -> str:
    """What makes the request itself unusable ('' when nothing does)."""
    if not request.text.strip():
        return "text is empty"
    if request.ttl_s < 0 or request.max_entries < 0:
        return "ttl_s and max_entries must not be negative"
    if not math.isfinite(request.ttl_s):
        # NaN never expires and is never served, yet counts against the tenant's bound.
        return f"ttl_s must be a finite number of seconds (0: the default), got {request.ttl_s}"
    if not request.prediction.label:
        return "refusing to cache a prediction with no label"
    scores = [request.prediction.score, *(s.score for s in request.prediction.top_k)]
    if bad := [score for score in scores if not math.isfinite(score)]:
        # A model that answered NaN is broken: every repeat would be served its NaN. Its count,
        # not every score: a message over gRPC's 16 KiB of metadata is RESOURCE_EXHAUSTED.
        return (
            f"refusing to cache a prediction with {len(bad)} of {len(scores)} scores not a "
            f"number (first: {bad[0]})"
        )
    if request.mode not in MODES:
        return f"mode must be 'exact' or 'semantic', got {clip(request.mode)!r}"
    if request.prediction.HasField("embedding"):
        return _embedding_problem(request.prediction.embedding)
    return ""


def _embedding_problem(tensor: common_pb2.Tensor) -> str:
    """What common.proto's "L2-normalised sentence embedding (FP32)" rules out: a stored
    tensor is served to every repeat as it is ('' when it is one)."""
    try:
        vector = from_tensor(tensor)
    except TensorError as exc:
        return f"prediction.embedding: {exc}"
    if vector.dtype != np.float32 or vector.ndim not in (1, 2) or vector.shape[-1] == 0:
        return (
            f"prediction.embedding must be FP32 of shape [dim] or [1, dim], got "
            f"{dtype_name(tensor.dtype)} {list(vector.shape)}"
        )
    if vector.ndim == 2 and vector.shape[0] != 1:
        return f"prediction.embedding holds {vector.shape[0]} rows; a prediction has one"
    if not np.isfinite(vector).all():
        return "prediction.embedding has values that are not numbers"
    return ""


def refused(code: grpc.StatusCode, message: str) -> cache_pb2.StoreResult:
    return cache_pb2.StoreResult(code=code.value[0], message=message)
