"""The gateway's side of the cache, on a request's path: what the gateway answers or vouches
for itself, the Lookup hop, and the store after a miss.

GatewayService.predict_text calls these in order (gateway/service.py says when):
`local_answer` (an exact repeat from the local tier, no hop), `known_miss` (an exact-only key
the key mirror vouches the cache does not hold: no Lookup), `look_up` (the Lookup hop within
its budget, behind the circuit breaker; a failure or overrun is FAIL_OPEN, never the
request's error), `record_outcome` (the one place an outcome is counted) and `store_later`
(the model's cache policy, then the write off the reply's path).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import grpc
from opentelemetry import trace

from hopline.gateway.admission import Admission
from hopline.gateway.cache_writes import CacheWrites
from hopline.gateway.call import PredictCall
from hopline.gateway.config import GatewayConfig
from hopline.gateway.exact_tier import LocalEntry, LocalExactTier
from hopline.gateway.key_mirror import KeyMirror
from hopline.gateway.resilience import CircuitBreaker, CircuitState
from hopline.gateway.speculation import Speculation
from hopline.gateway.upstream import HopError, Pool, Upstream, call_hop
from hopline.observability import metrics, schema
from hopline.observability.logs import Episodes
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.server import NOT_READY

log = logging.getLogger("hopline.gateway")
# Lookups that failed open, said once an episode: until the circuit opens (and at each probe
# after), every request's lookup fails while the cache is away.
LOOKUP_FAILURES = Episodes(log, "cache fail-open")
LOOKUPS = "lookups"
LOCAL_DETAIL = "answered by the gateway's local exact tier"
KNOWN_MISS_DETAIL = "not held by the cache (the gateway's key mirror): no lookup was sent"
EXACT, SEMANTIC = common_pb2.CACHE_OUTCOME_EXACT, common_pb2.CACHE_OUTCOME_SEMANTIC


class CachePath:
    """The cache's steps of predict_text, over the gateway's shared parts (the service holds
    the same objects: GetStats reads them, and the model's steps ask `expects_embedding`)."""

    def __init__(
        self,
        config: GatewayConfig,
        cache: Pool[cache_pb2_grpc.CacheServiceAsyncStub],
        admission: Admission,
        breaker: CircuitBreaker,
        exact_tier: LocalExactTier,
        key_mirror: KeyMirror,
        speculation: Speculation,
        writes: CacheWrites,
    ) -> None:
        self.config = config
        self.cache = cache
        self.admission = admission
        self.breaker = breaker
        self.exact_tier = exact_tier
        self.key_mirror = key_mirror
        self.speculation = speculation
        self.writes = writes
        self._mismatch_logged: set[str] = set()
        # The last lookup failed with no connection to the cache (not a cache that answered
        # UNAVAILABLE itself, as it does while Milvus is down): see _cache_back.
        self._unreachable = False

    def _cache_back(self) -> bool:
        """Whether the circuit's probe goes now: the cache was unreachable when the lookups
        failed and the gateway has a connection to it again. Before, a restarted cache was
        skipped until the cool-down ended (FAIL_OPEN 2-6 s after it served again, in a
        helper's probe with the default 5 s; for the whole cool-down when it is longer)."""
        if not (self._unreachable and isinstance(self.cache, Upstream) and self.cache.connected()):
            return False
        self._unreachable = False
        self.breaker.reconnected()
        return self.breaker.allow()

    def local_answer(self, call: PredictCall) -> common_pb2.Prediction | None:
        """An exact repeat this gateway holds, answered with no hop (the tier serves only
        while its watch of the cache is live: gateway/exact_tier.py)."""
        if not call.use_cache:
            return None
        now = time.time()
        local = self.exact_tier.get(call.key, now)
        if local is None:
            return None
        call.local = True
        call.cache.outcome = EXACT
        call.cache.similarity = 1.0
        call.cache.entry_id = call.key
        call.cache.age_s = max(0.0, now - local.created_at)
        call.cache.detail = LOCAL_DETAIL
        return local.prediction

    def expects_embedding(self, call: PredictCall) -> bool:
        """Whether the lookup will bring the text's embedding for the model's head: then the
        miss needs no token ids and no speculative run (a second encoder run at once)."""
        info = call.info
        return (
            self.config.share_embeddings
            and bool(info.head_embedder)
            and info.cache.mode == "semantic"
            and call.use_cache
        )

    def known_miss(self, call: PredictCall) -> bool:
        """A miss the key mirror vouches for: an exact-only model, and a key the cache does
        not hold, so no Lookup is sent (gateway/key_mirror.py). Not while the circuit is
        open or half-open: its probe is a lookup, and with every exact-only miss vouched for
        none would be sent, the circuit would never close, and no answer would be stored."""
        if not (
            call.use_cache
            and call.info.cache.mode == "exact"
            and self.breaker.state == CircuitState.CLOSED
            and self.key_mirror.known_miss(call.key)
        ):
            return False
        metrics.KNOWN_MISSES.inc()
        call.known_miss = True
        call.cache.outcome = common_pb2.CACHE_OUTCOME_MISS
        call.cache.detail = KNOWN_MISS_DETAIL
        return True

    async def look_up(self, call: PredictCall) -> common_pb2.Prediction | None:
        """The cache's hit, or None with MISS, FAIL_OPEN or SKIPPED set on the reply."""
        info = call.info
        if not call.use_cache:
            call.cache.outcome = common_pb2.CACHE_OUTCOME_SKIPPED
            call.cache.detail = (
                f"cache mode {info.cache.mode!r} for {info.name}"
                if info.cache.mode == "off"
                else f"request cache_mode {common_pb2.CacheMode.Name(call.mode)}"
            )
            return None
        if not self.breaker.allow() and not self._cache_back():
            call.cache.outcome = common_pb2.CACHE_OUTCOME_FAIL_OPEN
            call.fail_open_reason = "circuit_open"
            self.breaker.skipped()
            retry_s = self.breaker.retry_in()
            # 0 s left: a probe is on its way, or the cache cannot be reached (the probe goes
            # once it can); "retrying in 0.0s" read as now for the whole outage (a probe).
            when = f"in {retry_s:.1f}s" if retry_s >= 0.05 else "once a probe lookup answers"
            call.cache.detail = (
                f"cache circuit open after repeated failures; retrying the cache {when}"
            )
            return None
        probe = self.breaker.state == CircuitState.HALF_OPEN  # allowed: this is the probe
        if self.admission.skip_lookup(call):
            return None  # no time for it, or an overloaded cache: the reply says which
        generation = self.exact_tier.generation
        cache = self.cache
        budget_s = self.admission.lookup_budget_s(call)
        try:
            found: cache_pb2.LookupResponse = await call_hop(
                schema.SPAN_CACHE_LOOKUP,
                cache.target,
                cache.stub().Lookup,
                cache_pb2.LookupRequest(
                    scope=call.scope,
                    text=call.text,
                    mode=info.cache.mode,
                    threshold=info.cache.threshold,
                    verify_target=info.cache.verify_target,
                    verify_confidence=info.cache.verify_confidence,
                ),
                budget_s,
                call.timings,
            )
        except HopError as err:
            overran = err.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # Out of a budget the caller's deadline had cut to under half, a lookup says
            # nothing of the cache's health: counted, one client's tight deadlines opened the
            # circuit and every tenant's lookups were skipped (a fuzzing probe). A cache that
            # takes longer than half the budget still opens it (a reviewer: not counting any
            # cut lookup left a hung cache open to latency-bound callers for ever).
            if overran and budget_s < self.admission.cache_budget_s / 2:
                if probe:
                    self.breaker.inconclusive()
            else:
                self.admission.lookup_finished(overran=overran)
                self.breaker.failure()
                if err.code == grpc.StatusCode.UNAVAILABLE and NOT_READY in err.details:
                    self.breaker.starting()
            self._unreachable = (
                err.code == grpc.StatusCode.UNAVAILABLE
                and isinstance(self.cache, Upstream)
                and not self.cache.connected(try_to_connect=False)
            )
            call.cache.outcome = common_pb2.CACHE_OUTCOME_FAIL_OPEN
            call.fail_open_reason = err.code.name.lower()
            call.cache.detail = err.message
            LOOKUP_FAILURES.failed(LOOKUPS, err.code.name, status=err.code.name, reason=err.message)
            return None
        self.admission.lookup_finished(overran=False)
        self.breaker.success()
        self._unreachable = False
        LOOKUP_FAILURES.ended(LOOKUPS)
        call.verify_id = found.verify_id
        self._take_embedding(call, found)
        hit = found.outcome in (EXACT, SEMANTIC)
        self.speculation.record(info.name, hit)
        if not hit:
            call.cache.outcome = common_pb2.CACHE_OUTCOME_MISS
            return None
        call.cache.outcome = found.outcome
        call.cache.similarity = found.similarity
        call.cache.entry_id = found.entry_id
        call.cache.age_s = found.age_s
        if found.outcome == EXACT:
            self._keep_locally(call, found.prediction, time.time() - found.age_s, generation)
        return found.prediction

    def _take_embedding(self, call: PredictCall, found: cache_pb2.LookupResponse) -> None:
        """Keep the lookup's query embedding where the model's head takes it."""
        if not (found.embedder and self.expects_embedding(call)):
            return
        if found.embedder == call.info.head_embedder:
            call.embedding = found.query_embedding
        elif call.info.head_embedder not in self._mismatch_logged:
            self._mismatch_logged.add(call.info.head_embedder)  # once per model encoder
            log.warning(
                "the cache's embeddings are not this model's: its misses run on token ids",
                extra={
                    "model": f"{call.info.name}/{call.info.version}",
                    "head_embedder": call.info.head_embedder,
                    "cache_embedder": found.embedder,
                },
            )

    @staticmethod
    def record_outcome(call: PredictCall) -> None:
        """The one place a request's cache outcome is counted (GetStats reads these)."""
        _outcome_counter(call.info.name, outcome_name(call.cache.outcome)).inc()
        if call.local:
            metrics.LOCAL_EXACT_HITS.inc()
        if call.cache.outcome == common_pb2.CACHE_OUTCOME_FAIL_OPEN:
            metrics.CACHE_FAIL_OPEN.labels(call.fail_open_reason).inc()

    def store_later(self, call: PredictCall, prediction: common_pb2.Prediction) -> None:
        """Write the answer to the cache off the reply's path, if the model's policy wants it."""
        policy = call.info.cache
        if (prediction.out_of_scope and not policy.store_out_of_scope) or (
            prediction.score < policy.min_score
        ):
            metrics.CACHE_STORES.labels("skipped_policy").inc()
            return
        if self.breaker.state != CircuitState.CLOSED:
            # A failing cache gets no writes either; the probe lookup decides. Counted: the
            # answers given while the circuit was open were written nowhere, unsaid (an SRE's
            # probe: 193 of 197 during a cache restart).
            metrics.CACHE_STORES.labels("skipped_circuit_open").inc()
            return
        # Held from now: a repeat arriving before the store returns is looked up (the cache
        # answers it from its pending writes), never vouched a miss. A store that fails
        # leaves a key held wrongly, which only costs a lookup.
        self.key_mirror.hold(call.scope, (call.key,))
        # Kept from now too: a store lingers before it is sent (HOPLINE_GATEWAY_STORE_LINGER_MS),
        # and a repeat meanwhile is this gateway's to answer. Not within FENCE_S of an
        # invalidation of its key or scope (the tier refuses the copy), which the cache fences
        # too: a repeat then misses once more, as docs/cache.md says.
        self._keep_locally(call, prediction, time.time(), self.exact_tier.generation)
        # The write itself once the reply is on its way: the handler returns the reply to
        # gRPC, which starts its send before the loop turns to this. The key is held and kept
        # above, so a repeat meanwhile is still this gateway's to answer. A recorded
        # request's store starts now, under its span: by then the span has ended, and the
        # store's own span (gateway/store_queue.py) is opened only under a live one.
        if trace.get_current_span().is_recording():
            self.writes.store(call, prediction)
        else:
            asyncio.get_running_loop().call_soon(self.writes.store, call, prediction)

    def _keep_locally(
        self,
        call: PredictCall,
        prediction: common_pb2.Prediction,
        created: float,
        generation: int,
    ) -> None:
        """Copy an exact entry to the local tier, expiring when the cache's entry does."""
        ttl_s = call.info.cache.ttl_s
        if ttl_s > 0:
            entry = LocalEntry(prediction, call.scope_key, created, created + ttl_s)
            self.exact_tier.put(call.key, entry, generation)


_OUTCOMES = {
    number: name.removeprefix("CACHE_OUTCOME_").lower()
    for name, number in common_pb2.CacheOutcome.items()
}


def outcome_name(outcome: common_pb2.CacheOutcome.ValueType) -> str:
    return _OUTCOMES[outcome]


@functools.lru_cache(maxsize=4096)
def _outcome_counter(model: str, outcome: str) -> Any:
    """The counter's child, resolved once per (model, outcome): labels() costs a lock."""
    return metrics.CACHE_OUTCOMES.labels(model, outcome)
