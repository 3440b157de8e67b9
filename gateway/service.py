"""hopline.gateway.v1.GatewayService: validates, resolves the model, and runs the hops.

Two APIs share one prediction path: the gateway's own Predict and the KServe v2 ModelInfer
(hopline.gateway.open_inference), which validate, resolve the tenant and the model, and run
`predict_text` per text.

`predict_text` reads as its steps:
1. `_answer_from_local_tier`: an exact repeat the gateway holds is answered with no hop.
2. `_tokenize` starts, `_speculate` may start the inference too (gateway/speculation.py
   says when), and `_look_up_cache` runs meanwhile (the lookup needs no token ids).
3. `_record_outcome`: the one place a request's cache outcome is counted.
4. On a miss, `_infer_once` (or the speculative one, already running): tokenize -> infer ->
   postprocess, shared by identical concurrent misses; then `_store_later` (fire-and-forget,
   after the model's cache policy). On a hit, the speculative inference is cancelled.
5. `_finish`: span attributes and timings on the reply.
The cache never makes the mesh less available: a lookup that fails or overruns its budget is
reported as FAIL_OPEN and the request goes on to inference, and a circuit breaker stops
calling a failing cache for a cool-down.

Counts live in Prometheus (hopline.observability.metrics), one per process; GetStats reads
them, so a scrape and GetStats cannot disagree.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterable
from typing import Any, cast

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from hopline.gateway.admission import Admission
from hopline.gateway.cache_writes import CacheWrites, spawn
from hopline.gateway.call import PredictCall, check_cache_mode, discard
from hopline.gateway.catalogue import ModelCatalogue
from hopline.gateway.config import GatewayConfig
from hopline.gateway.errors import RequestError
from hopline.gateway.exact_tier import LocalEntry, LocalExactTier
from hopline.gateway.identity import IdentityError, TenantResolver
from hopline.gateway.key_mirror import KeyMirror
from hopline.gateway.resilience import CircuitBreaker, CircuitState, Coalescer
from hopline.gateway.speculation import Speculation
from hopline.gateway.stage_batching import GatewayStages
from hopline.gateway.streaming import predict_stream
from hopline.gateway.upstream import GatewayUpstreams, HopError, call_hop
from hopline.observability import metrics, schema
from hopline.observability.loop_metrics import LoopCounter
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2
from hopline.runtime.errors import ECHO_CHARS, StatusError, clip

log = logging.getLogger("hopline.gateway")
LOCAL_DETAIL = "answered by the gateway's local exact tier"
KNOWN_MISS_DETAIL = "not held by the cache (the gateway's key mirror): no lookup was sent"
EXACT, SEMANTIC = common_pb2.CACHE_OUTCOME_EXACT, common_pb2.CACHE_OUTCOME_SEMANTIC

Context = grpc.aio.ServicerContext[gateway_pb2.PredictRequest, gateway_pb2.PredictResponse]


# GetStats counter -> the Prometheus counter it reads and the labels it is summed over.
COUNTS: dict[str, tuple[Counter | LoopCounter, dict[str, str]]] = {
    "requests": (metrics.GATEWAY_REQUESTS, {}),
    "kserve_infer_requests": (metrics.GATEWAY_CALLS, {"method": "ModelInfer"}),
    "streams": (metrics.GATEWAY_CALLS, {"method": "PredictStream"}),
    "inferences": (metrics.INFERENCES, {}),
    "coalesced": (metrics.COALESCED, {}),
    "speculative_used": (metrics.SPECULATIVE, {"result": "used"}),
    "speculative_wasted": (metrics.SPECULATIVE, {"result": "wasted"}),
    "cache_exact": (metrics.CACHE_OUTCOMES, {"outcome": "exact"}),
    "cache_exact_local": (metrics.LOCAL_EXACT_HITS, {}),
    "cache_semantic": (metrics.CACHE_OUTCOMES, {"outcome": "semantic"}),
    "cache_miss": (metrics.CACHE_OUTCOMES, {"outcome": "miss"}),
    "cache_known_miss": (metrics.KNOWN_MISSES, {}),
    "cache_skipped": (metrics.CACHE_OUTCOMES, {"outcome": "skipped"}),
    "cache_fail_open": (metrics.CACHE_FAIL_OPEN, {}),
    "cache_circuit_open": (metrics.CACHE_FAIL_OPEN, {"reason": "circuit_open"}),
    "stores": (metrics.CACHE_STORES, {"result": "stored"}),
    "stores_skipped_policy": (metrics.CACHE_STORES, {"result": "skipped_policy"}),
    "store_errors": (metrics.CACHE_STORES, {"result": "error"}),
}


class GatewayService(gateway_pb2_grpc.GatewayServiceServicer):
    service_names = (
        gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
        # KServe v2's wire name, written out: importing its stubs here would load them into
        # every process that imports the gateway, and tritonclient's stubs claim the same
        # protobuf package (tests/mesh/test_kserve.py checks health answers for this name).
        "inference.GRPCInferenceService",
    )

    def __init__(self, config: GatewayConfig, upstreams: GatewayUpstreams | None = None) -> None:
        self.config = config
        self.upstreams = upstreams or GatewayUpstreams.connect(config)
        self.catalogue = ModelCatalogue(self.upstreams.inference)
        self.tenants = TenantResolver(config.api_keys)
        self.serving = False
        self.breaker = CircuitBreaker(
            config.cache_breaker_failures, config.cache_breaker_cooldown_s
        )
        self.coalescer: Coalescer[common_pb2.Prediction] = Coalescer()
        self.speculation = Speculation(config.speculate, config.speculate_max_hit_rate)
        self._mismatch_logged: set[str] = set()
        self.stages = (
            GatewayStages.over(
                self.upstreams,
                config.batch_in_flight,
                config.batch_max_rows,
                self._model_rows,
                (lambda: self.admission.in_flight > 1) if config.batch_gather else None,
                config.batch_linger_ms / 1e3,
            )
            if config.batch_max_rows > 1
            else None
        )
        self.admission = Admission(
            config.max_in_flight, config.cache_budget_ms, config.cache_adaptive
        )
        self.exact_tier = LocalExactTier(config.local_exact_entries)
        self.key_mirror = KeyMirror(config.key_mirror_keys)
        self._loops: set[asyncio.Task[None]] = set()  # run for the life of the process
        self.writes = CacheWrites(
            self.upstreams.cache,
            batched=self.stages is not None,
            linger_s=config.store_linger_ms / 1e3,
            in_flight=config.batch_in_flight,
        )

    def register(self, server: grpc.aio.Server) -> None:
        # Imported here: the KServe servicer builds on this module's GatewayService.
        from hopline.gateway.open_inference import OpenInferenceService

        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(self, server)
        OpenInferenceService(self).register(server)

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        # Not SERVING until co-located services are, and inference has said which models exist.
        await self.upstreams.start()
        while True:
            try:
                await self.catalogue.refresh()
                break
            except grpc.aio.AioRpcError as err:
                log.info(
                    "waiting for inference",
                    extra={"target": self.upstreams.inference.target, "status": err.code().name},
                )
                await asyncio.sleep(0.5)
        log.info("models", extra={"models": sorted(f"{n}/{v}" for n, v in self.models)})
        spawn(self.catalogue.follow(self.config.model_refresh_s), self._loops)
        if self.exact_tier.capacity > 0 or self.key_mirror.capacity > 0:
            spawn(self.exact_tier.follow(self._watch_cache, self.key_mirror), self._loops)
        self.serving = True

    def _model_rows(self, name: str, version: str) -> int:
        info = self.models.get((name, version))
        return info.max_batch_size if info is not None else 0

    def _watch_cache(self) -> AsyncIterable[cache_pb2.WatchInvalidationsResponse]:
        return self.upstreams.cache.stub().WatchInvalidations(
            cache_pb2.WatchInvalidationsRequest(keys=self.key_mirror.capacity > 0)
        )

    def begin_drain(self) -> None:
        """SIGTERM: KServe's ServerReady and ModelReady answer false from now on, as health
        does, while calls are still served for the drain delay (runtime/server.py)."""
        self.serving = False

    async def stop(self) -> None:
        self.serving = False
        await self.writes.close()  # pending cache writes land before the channels close
        for task in self._loops:
            task.cancel()
        if self.stages is not None:
            await self.stages.close()
        await self.upstreams.close()

    # -- validation -----------------------------------------------------------------------

    @property
    def models(self) -> dict[tuple[str, str], inference_pb2.ModelInfo]:
        return self.catalogue.models

    async def resolve_model(self, name: str, version: str) -> inference_pb2.ModelInfo:
        try:
            return await self.catalogue.resolve(name, version)
        except RequestError as err:
            if err.code != grpc.StatusCode.NOT_FOUND or max(len(name), len(version)) <= ECHO_CHARS:
                raise
            # The catalogue's message echoes the name whole: say it again, clipped.
            known = ", ".join(sorted(f"{n}/{v}" for n, v in self.models)) or "none"
            wanted = f"{clip(name)}/{clip(version)}" if version else clip(name)
            raise RequestError(err.code, f"unknown model {wanted!r} (serving: {known})") from None

    def check_text(self, text: str, where: str = "PredictRequest.text") -> None:
        if not text.strip():
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"text is empty: put the text to classify in {where}",
            )
        size = len(text.encode("utf-8"))
        if size > self.config.max_text_bytes:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"text is {size} bytes; the limit is {self.config.max_text_bytes} "
                "(HOPLINE_MAX_TEXT_BYTES)",
            )

    def timeout_for(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        # grpc returns None without a deadline, whatever the stubs say.
        remaining = cast("float | None", context.time_remaining())
        if remaining is None:
            return self.config.upstream_timeout_s
        return min(float(remaining), self.config.upstream_timeout_s)

    # -- RPCs -----------------------------------------------------------------------------

    async def Predict(
        self, request: gateway_pb2.PredictRequest, context: Context
    ) -> gateway_pb2.PredictResponse:
        try:
            return await self.answer(
                request, context.invocation_metadata() or (), self.timeout_for(context)
            )
        except StatusError as err:
            await context.abort(err.code, err.message)

    async def PredictStream(
        self,
        request_iterator: AsyncIterator[gateway_pb2.PredictStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[gateway_pb2.PredictStreamResponse]:
        async for reply in predict_stream(self, request_iterator, context):
            yield reply

    async def GetStats(
        self,
        request: gateway_pb2.GetStatsRequest,
        context: grpc.aio.ServicerContext[
            gateway_pb2.GetStatsRequest, gateway_pb2.GetStatsResponse
        ],
    ) -> gateway_pb2.GetStatsResponse:
        try:
            self.tenants.require_key(context.invocation_metadata() or ())
        except IdentityError as err:
            await context.abort(err.code, err.message)
        return gateway_pb2.GetStatsResponse(
            counters={
                **{name: metrics.count(c, **labels) for name, (c, labels) in COUNTS.items()},
                "cache_circuit_opened": self.breaker.opened,
                "stores_in_flight": self.writes.in_flight,
                "coalescing_in_flight": len(self.coalescer),
                "local_exact_entries": len(self.exact_tier),
                "local_exact_live": int(self.exact_tier.live),
                "key_mirror_keys": len(self.key_mirror),
                "key_mirror_synced": int(self.key_mirror.synced),
            },
            cache_circuit=self.breaker.state.value,
        )

    async def answer(
        self,
        request: gateway_pb2.PredictRequest,
        metadata: Iterable[tuple[str, str | bytes]],
        timeout_s: float,
    ) -> gateway_pb2.PredictResponse:
        """One Predict; raises a StatusError (RequestError, IdentityError or HopError)."""
        started = time.perf_counter()
        metrics.GATEWAY_REQUESTS.inc()
        # Who is asking first: a caller without a key learns nothing about the request.
        tenant = self.tenants.resolve(request.tenant, metadata)
        self.check_text(request.text)
        check_cache_mode(request.cache_mode)
        info = await self.resolve_model(
            request.model or self.config.default_model, request.model_version
        )
        top_k = request.top_k or 1
        if not 1 <= top_k <= len(info.labels):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"top_k must be 1 to {len(info.labels)} for {info.name}, got {request.top_k}",
            )
        return await self.predict_text(
            request.text, info, tenant, top_k, request.cache_mode, timeout_s, started
        )

    # -- the prediction path --------------------------------------------------------------

    async def predict_text(
        self,
        text: str,
        info: inference_pb2.ModelInfo,
        tenant: str,
        top_k: int,
        cache_mode: common_pb2.CacheMode.ValueType,
        timeout_s: float,
        started: float,
    ) -> gateway_pb2.PredictResponse:
        """One validated text through cache and hops; raises HopError when a hop fails."""
        call = PredictCall.new(text, info, tenant, top_k, cache_mode, timeout_s, started)
        speculative: asyncio.Future[tuple[common_pb2.Prediction, bool]] | None = None
        prediction = self._answer_from_local_tier(call)
        # Refused at once (a RequestError) past the in-flight limit or the deadline's reach.
        with self.admission.admit(call, free=prediction is not None):
            if prediction is None and not self._known_miss(call):
                if call.use_cache and not self._expects_embedding(call):
                    self._tokenize_early(call)  # beside the lookup
                speculative = self._speculate(call)
                prediction = await self._look_up_cache(call)
            self._record_outcome(call)
            if prediction is None:
                prediction, ran_here = await (speculative or self._infer_once(call))
                if ran_here and call.may_store:
                    self._store_later(call, prediction)
                self.writes.report(call, prediction)
            elif call.verify_id:  # the cache wants the model's answer too, after this reply
                self.writes.spawn(self._verify(call, speculative))
            else:
                call.drop_tokens()
                if speculative is not None:
                    discard(speculative)
                    metrics.SPECULATIVE.labels("wasted").inc()
        return self._finish(call, prediction)

    def _answer_from_local_tier(self, call: PredictCall) -> common_pb2.Prediction | None:
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

    def _expects_embedding(self, call: PredictCall) -> bool:
        """Whether the lookup will bring the text's embedding for the model's head: then the
        miss needs no token ids and no speculative run (a second encoder run at once)."""
        info = call.info
        return (
            self.config.share_embeddings
            and bool(info.head_embedder)
            and info.cache.mode == "semantic"
            and call.use_cache
        )

    def _known_miss(self, call: PredictCall) -> bool:
        """A miss the key mirror vouches for: an exact-only model, and a key the cache does
        not hold, so no Lookup is sent (gateway/key_mirror.py)."""
        if not (
            call.use_cache
            and call.info.cache.mode == "exact"
            and self.key_mirror.known_miss(call.key)
        ):
            return False
        metrics.KNOWN_MISSES.inc()
        call.known_miss = True
        call.cache.outcome = common_pb2.CACHE_OUTCOME_MISS
        call.cache.detail = KNOWN_MISS_DETAIL
        return True

    def _tokenize_early(self, call: PredictCall) -> None:
        """Ask for the text's token ids now, in a task of their own, so the cache lookup
        overlaps them (a request with no lookup to wait for tokenizes in its own task)."""
        call.tokenizing = asyncio.ensure_future(self._tokenize_hop(call))

    async def _tokens(self, call: PredictCall) -> tokenizer_pb2.TokenizeResponse:
        """The text's token ids: the early request's, else asked for now."""
        if call.tokenizing is not None:
            return await call.tokenizing
        return await self._tokenize_hop(call)

    def _tokenize_hop(self, call: PredictCall) -> Awaitable[tokenizer_pb2.TokenizeResponse]:
        tokenizer = self.upstreams.tokenizer
        return call_hop(
            schema.SPAN_TOKENIZE,
            tokenizer.target,
            self.stages.tokenize if self.stages else tokenizer.stub().Tokenize,
            tokenizer_pb2.TokenizeRequest(
                model=call.info.name, model_version=call.info.version, texts=[call.text]
            ),
            call.timeout_s,
            call.timings,
        )

    async def _look_up_cache(self, call: PredictCall) -> common_pb2.Prediction | None:
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
        if not self.breaker.allow():
            call.cache.outcome = common_pb2.CACHE_OUTCOME_FAIL_OPEN
            call.fail_open_reason = "circuit_open"
            call.cache.detail = (
                f"cache circuit open after repeated failures; retrying the cache in "
                f"{self.breaker.retry_in():.1f}s"
            )
            return None
        if self.admission.skip_lookup(call):
            return None  # no time for it, or an overloaded cache: the reply says which
        generation = self.exact_tier.generation
        cache = self.upstreams.cache
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
                self.admission.lookup_budget_s(call),
                call.timings,
            )
        except HopError as err:
            self.admission.lookup_finished(overran=err.code == grpc.StatusCode.DEADLINE_EXCEEDED)
            self.breaker.failure()
            call.cache.outcome = common_pb2.CACHE_OUTCOME_FAIL_OPEN
            call.fail_open_reason = err.code.name.lower()
            call.cache.detail = err.message
            log.warning("cache fail-open", extra={"reason": err.message})
            return None
        self.admission.lookup_finished(overran=False)
        self.breaker.success()
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
        if not (found.embedder and self._expects_embedding(call)):
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

    def _speculate(
        self, call: PredictCall
    ) -> asyncio.Future[tuple[common_pb2.Prediction, bool]] | None:
        """The inference started now, beside the lookup, when the policy says it pays."""
        # Only beside a lookup that will be made (allow() would take a half-open probe).
        if not (call.use_cache and self.breaker.state == CircuitState.CLOSED):
            return None
        if self._expects_embedding(call):
            return None
        if not self.speculation.should(call.info.name):
            return None
        call.speculative = True
        return asyncio.ensure_future(self._infer_once(call))

    def _record_outcome(self, call: PredictCall) -> None:
        """The one place a request's cache outcome is counted (GetStats reads these)."""
        _outcome_counter(call.info.name, _outcome(call.cache.outcome)).inc()
        if call.local:
            metrics.LOCAL_EXACT_HITS.inc()
        if call.cache.outcome == common_pb2.CACHE_OUTCOME_FAIL_OPEN:
            metrics.CACHE_FAIL_OPEN.labels(call.fail_open_reason).inc()

    async def _infer_once(self, call: PredictCall) -> tuple[common_pb2.Prediction, bool]:
        """An inference for this text, shared with identical plain misses running now, and
        whether it ran for this request (the one that ran it stores the answer)."""
        if call.mode != common_pb2.CACHE_MODE_USE:
            # REFRESH and BYPASS ask for an inference of their own.
            return await self._tokenize_infer_postprocess(call), True
        waited = time.perf_counter()
        prediction, shared = await self.coalescer.run(
            call.key, lambda: self._tokenize_infer_postprocess(call)
        )
        if shared:
            call.drop_tokens()
            metrics.COALESCED.inc()
            call.cache.coalesced = True
            call.timings["coalesced_wait"] = (time.perf_counter() - waited) * 1e3
        if call.speculative:
            metrics.SPECULATIVE.labels("used").inc()
        return prediction, not shared

    async def _tokenize_infer_postprocess(self, call: PredictCall) -> common_pb2.Prediction:
        metrics.INFERENCES.inc()
        info, inference, postprocess = (
            call.info,
            self.upstreams.inference,
            self.upstreams.postprocess,
        )
        if call.embedding is not None:
            inputs = [call.embedding]  # the head alone (_take_embedding)
        else:
            tokens = await self._tokens(call)
            inputs = [tokens.input_ids, tokens.attention_mask]
        inferred: inference_pb2.InferResponse = await call_hop(
            schema.SPAN_INFERENCE,
            inference.target,
            self.stages.infer if self.stages else inference.stub().Infer,
            inference_pb2.InferRequest(
                model=info.name,
                model_version=info.version,
                inputs=inputs,
                outputs=["logits"],
            ),
            call.timeout_s,
            call.timings,
        )
        call.timings["inference.queue"] = inferred.queue_ms
        call.timings["inference.compute"] = inferred.compute_ms
        post: postprocess_pb2.PostprocessResponse = await call_hop(
            schema.SPAN_POSTPROCESS,
            postprocess.target,
            self.stages.postprocess if self.stages else postprocess.stub().Postprocess,
            postprocess_pb2.PostprocessRequest(
                model=info.name,
                model_version=info.version,
                outputs=inferred.outputs,
                top_k=call.top_k,
            ),
            call.timeout_s,
            call.timings,
        )
        return post.predictions[0]

    async def _verify(
        self,
        call: PredictCall,
        speculative: asyncio.Future[tuple[common_pb2.Prediction, bool]] | None,
    ) -> None:
        """The model's answer for a served semantic hit, reported to the cache (after the
        reply: the cached answer is never delayed by it). A speculative run is reused."""
        try:
            if speculative is not None:
                prediction, _ = await speculative
            else:
                prediction = await self._tokenize_infer_postprocess(call)
        except HopError as err:
            log.warning("verification inference failed", extra={"status": err.code.name})
            return
        await self.writes.send_report(call, prediction)

    def _store_later(self, call: PredictCall, prediction: common_pb2.Prediction) -> None:
        """Write the answer to the cache off the reply's path, if the model's policy wants it."""
        policy = call.info.cache
        if (prediction.out_of_scope and not policy.store_out_of_scope) or (
            prediction.score < policy.min_score
        ):
            metrics.CACHE_STORES.labels("skipped_policy").inc()
            return
        if self.breaker.state != CircuitState.CLOSED:
            return  # a failing cache gets no writes either; the probe lookup decides
        # Held from now: a repeat arriving before the store returns is looked up (the cache
        # answers it from its pending writes), never vouched a miss. A store that fails
        # leaves a key held wrongly, which only costs a lookup.
        self.key_mirror.hold(call.scope, (call.key,))
        # Kept from now too: a store lingers before it is sent (HOPLINE_GATEWAY_STORE_LINGER_MS),
        # and a repeat meanwhile is this gateway's to answer. One the cache then refuses is
        # still the model's answer for this scope, so it may be served until it expires.
        self._keep_locally(call, prediction, time.time(), self.exact_tier.generation)
        self.writes.store(call, prediction)

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

    @staticmethod
    def _finish(
        call: PredictCall, prediction: common_pb2.Prediction
    ) -> gateway_pb2.PredictResponse:
        response = call.response
        response.prediction.CopyFrom(prediction)
        span = trace.get_current_span()
        if span.is_recording():  # most requests' traces are not: skip building the dict
            span.set_attributes(
                {
                    schema.MODEL: response.model,
                    schema.MODEL_VERSION: response.model_version,
                    schema.TENANT: response.tenant,
                    schema.CACHE_OUTCOME: _outcome(response.cache.outcome),
                    schema.CACHE_SIMILARITY: response.cache.similarity,
                    schema.CACHE_COALESCED: response.cache.coalesced,
                    schema.CACHE_LOCAL: call.local,
                    schema.CACHE_KNOWN_MISS: call.known_miss,
                    schema.SPECULATIVE: call.speculative,
                    schema.CACHE_EMBEDDING_USED: call.embedding is not None,
                }
            )
        call.timings["total"] = (time.perf_counter() - call.started) * 1e3
        response.timings.extend(
            common_pb2.HopTiming(hop=h, ms=ms) for h, ms in call.timings.items()
        )
        return response


_OUTCOMES = {
    number: name.removeprefix("CACHE_OUTCOME_").lower()
    for name, number in common_pb2.CacheOutcome.items()
}


def _outcome(outcome: common_pb2.CacheOutcome.ValueType) -> str:
    return _OUTCOMES[outcome]


@functools.lru_cache(maxsize=4096)
def _outcome_counter(model: str, outcome: str) -> Any:
    """The counter's child, resolved once per (model, outcome): labels() costs a lock."""
    return metrics.CACHE_OUTCOMES.labels(model, outcome)
