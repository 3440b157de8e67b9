"""hopline.gateway.v1.GatewayService: validates, resolves the model, and runs the hops.

Two APIs share one prediction path: the gateway's own Predict and the KServe v2 ModelInfer
(hopline.gateway.open_inference), which validate, resolve the tenant and the model, and run
`predict_text` per text through the same helpers here.

Tokenization and the cache lookup start together (the lookup needs no token ids); a hit
short-circuits the rest. The cache never makes the mesh less available: a lookup that fails
or overruns its budget is reported as FAIL_OPEN and the request goes on to inference, and
a circuit breaker stops calling a failing cache for a cool-down. Identical concurrent misses
share one inference. Stores are fire-and-forget, off the reply's critical path, and follow
the model's cache policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, cast

import grpc
from opentelemetry import trace

from hopline.cache.keys import exact_key, scope_tuple
from hopline.gateway.errors import STATUS_ERRORS, RequestError
from hopline.gateway.exact_tier import LocalEntry, LocalExactTier
from hopline.gateway.identity import TenantResolver
from hopline.gateway.resilience import CircuitBreaker, Coalescer
from hopline.gateway.streaming import predict_stream
from hopline.gateway.upstream import HopError, Upstream, call_hop
from hopline.observability import metrics, schema
from hopline.observability.tracing import current_trace_id
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.kserve.v2 import grpc_predict_v2_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.config import (
    DEFAULT_ADDRS,
    ServerConfig,
    addr_env,
    env_field,
    metrics_port_field,
)

log = logging.getLogger("hopline.gateway")
LOCAL_DETAIL = "answered by the gateway's local exact tier"

Context = grpc.aio.ServicerContext[gateway_pb2.PredictRequest, gateway_pb2.PredictResponse]


def _upstream_field(service: str) -> Any:
    return env_field(addr_env(service), DEFAULT_ADDRS[service], f"where the {service} listens")


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    listen: str = env_field("HOPLINE_GATEWAY_ADDR", DEFAULT_ADDRS["gateway"], "address to bind")
    metrics_port: int = metrics_port_field("gateway")
    tokenizer_addr: str = _upstream_field("tokenizer")
    cache_addr: str = _upstream_field("cache")
    inference_addr: str = _upstream_field("inference")
    postprocess_addr: str = _upstream_field("postprocess")
    default_model: str = env_field(
        "HOPLINE_DEFAULT_MODEL", "support-intents", "model used when a request names none"
    )
    local_exact_entries: int = env_field(
        "HOPLINE_GATEWAY_EXACT_ENTRIES",
        10_000,
        "exact cache entries the gateway keeps to answer repeats without a hop (0: none); "
        "served only while its invalidation watch on the cache is live",
    )
    channels_per_upstream: int = env_field(
        "HOPLINE_CHANNELS_PER_UPSTREAM", 2, "connections the gateway keeps to each upstream"
    )
    # Measured through the gateway on 2 cores, full CLINC150 eval (15k entries, a store after
    # every miss): semantic lookups p99 25 ms, p50 17 ms. 40 ms leaves room for a busier
    # machine without letting a sick cache add more than a model run to every request.
    cache_budget_ms: float = env_field(
        "HOPLINE_CACHE_BUDGET_MS", 40.0, "a cache lookup slower than this fails open"
    )
    cache_breaker_failures: int = env_field(
        "HOPLINE_CACHE_BREAKER_FAILURES", 5, "consecutive cache failures that open the circuit"
    )
    cache_breaker_cooldown_s: float = env_field(
        "HOPLINE_CACHE_BREAKER_COOLDOWN_S", 5.0, "how long an open circuit skips the cache"
    )
    api_keys: str = env_field(
        "HOPLINE_API_KEYS", "", "JSON file of API key -> tenant; when set, a key is required"
    )
    upstream_timeout_s: float = env_field(
        "HOPLINE_UPSTREAM_TIMEOUT_S", 10.0, "per-hop timeout when the client sets no deadline"
    )
    max_text_bytes: int = env_field(
        "HOPLINE_MAX_TEXT_BYTES", 16384, "longest text accepted, in UTF-8 bytes"
    )
    stream_max_in_flight: int = env_field(
        "HOPLINE_STREAM_MAX_IN_FLIGHT",
        64,
        "requests of one PredictStream answered at once; past it the gateway stops reading",
    )
    model_refresh_s: float = env_field(
        "HOPLINE_MODEL_REFRESH_S", 10.0, "how often the model list is re-read from inference"
    )


class GatewayService(gateway_pb2_grpc.GatewayServiceServicer):
    service_names = (
        gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
        grpc_predict_v2_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    )

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        n, size = config.channels_per_upstream, config.max_message_bytes
        self.tokenizer = Upstream(
            schema.SPAN_TOKENIZE,
            config.tokenizer_addr,
            tokenizer_pb2_grpc.TokenizerServiceStub,
            n,
            size,
        )
        self.cache = Upstream(
            schema.SPAN_CACHE_LOOKUP, config.cache_addr, cache_pb2_grpc.CacheServiceStub, n, size
        )
        self.inference = Upstream(
            schema.SPAN_INFERENCE,
            config.inference_addr,
            inference_pb2_grpc.InferenceServiceStub,
            n,
            size,
        )
        self.postprocess = Upstream(
            schema.SPAN_POSTPROCESS,
            config.postprocess_addr,
            postprocess_pb2_grpc.PostprocessServiceStub,
            n,
            size,
        )
        self.models: dict[tuple[str, str], inference_pb2.ModelInfo] = {}
        self.latest: dict[str, str] = {}
        self._last_refresh = 0.0
        self._refresh_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self.tenants = TenantResolver(config.api_keys)
        self.serving = False
        self.breaker = CircuitBreaker(
            config.cache_breaker_failures, config.cache_breaker_cooldown_s
        )
        self.coalescer: Coalescer[common_pb2.Prediction] = Coalescer()
        self.exact_tier = LocalExactTier(config.local_exact_entries)
        self.counters = dict.fromkeys(
            (
                "requests",
                "kserve_infer_requests",
                "streams",
                "inferences",
                "coalesced",
                "cache_exact",
                "cache_exact_local",
                "cache_semantic",
                "cache_miss",
                "cache_skipped",
                "cache_fail_open",
                "cache_circuit_open",
                "stores",
                "stores_skipped_policy",
                "store_errors",
            ),
            0,
        )

    def register(self, server: grpc.aio.Server) -> None:
        # Imported here: the KServe servicer builds on this module's GatewayService.
        from hopline.gateway.open_inference import OpenInferenceService

        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(self, server)
        OpenInferenceService(self).register(server)

    # -- model catalogue ------------------------------------------------------------------

    async def _refresh_models(self) -> None:
        response = await self.inference.stub().ListModels(
            inference_pb2.ListModelsRequest(), timeout=5.0
        )
        models = {(m.name, m.version): m for m in response.models}
        latest: dict[str, str] = {}
        for name, version in models:
            if int(version) > int(latest.get(name, "0")):
                latest[name] = version
        self.models, self.latest = models, latest
        self._last_refresh = time.monotonic()

    async def start(self) -> None:
        # Not SERVING until the inference service has told us which models exist.
        while True:
            try:
                await self._refresh_models()
                break
            except grpc.aio.AioRpcError as err:
                log.info(
                    "waiting for inference",
                    extra={"target": self.inference.target, "status": err.code().name},
                )
                await asyncio.sleep(0.5)
        log.info("models", extra={"models": sorted(f"{n}/{v}" for n, v in self.models)})
        self._spawn(self._refresh_loop())
        if self.exact_tier.capacity > 0:
            self._spawn(self.exact_tier.follow(self._watch_cache))
        self.serving = True

    def _watch_cache(self) -> AsyncIterable[cache_pb2.WatchInvalidationsResponse]:
        return self.cache.stub().WatchInvalidations(cache_pb2.WatchInvalidationsRequest())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.model_refresh_s)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._refresh_models()

    async def _resolve(self, name: str, version: str) -> inference_pb2.ModelInfo | None:
        key = (name, version or self.latest.get(name, ""))
        if key not in self.models and time.monotonic() - self._last_refresh > 1.0:
            async with self._refresh_lock:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self._refresh_models()
            key = (name, version or self.latest.get(name, ""))
        return self.models.get(key)

    async def resolve_model(self, name: str, version: str) -> inference_pb2.ModelInfo:
        info = await self._resolve(name, version)
        if info is None:
            known = ", ".join(sorted(f"{n}/{v}" for n, v in self.models)) or "none"
            wanted = f"{name}/{version}" if version else name
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"unknown model {wanted!r} (serving: {known})"
            )
        return info

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

    async def stop(self) -> None:
        self.serving = False
        stores = [t for t in self._background if not t.get_name().startswith("loop")]
        if stores:  # let pending cache writes land before the channels close
            await asyncio.wait(stores, timeout=2.0)
        for task in self._background:
            task.cancel()
        for upstream in (self.tokenizer, self.cache, self.inference, self.postprocess):
            await upstream.close()

    def _spawn(self, coro: Any, name: str = "loop") -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- Predict --------------------------------------------------------------------------

    def timeout_for(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        # grpc returns None without a deadline, whatever the stubs say.
        remaining = cast("float | None", context.time_remaining())
        if remaining is None:
            return self.config.upstream_timeout_s
        return min(float(remaining), self.config.upstream_timeout_s)

    async def Predict(
        self, request: gateway_pb2.PredictRequest, context: Context
    ) -> gateway_pb2.PredictResponse:
        try:
            return await self.answer(
                request, context.invocation_metadata() or (), self.timeout_for(context)
            )
        except STATUS_ERRORS as err:
            await context.abort(err.code, err.message)

    async def PredictStream(
        self,
        request_iterator: AsyncIterator[gateway_pb2.PredictStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[gateway_pb2.PredictStreamResponse]:
        async for reply in predict_stream(self, request_iterator, context):
            yield reply

    async def answer(
        self,
        request: gateway_pb2.PredictRequest,
        metadata: Iterable[tuple[str, str | bytes]],
        timeout_s: float,
    ) -> gateway_pb2.PredictResponse:
        """One Predict; raises RequestError, IdentityError or HopError with its status."""
        started = time.perf_counter()
        self.counters["requests"] += 1
        self.check_text(request.text)
        tenant = self.tenants.resolve(request.tenant, metadata)
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
        timings: dict[str, float] = {}
        # Every parameter that changes the answer is part of the scope, hence of every key.
        scope = common_pb2.Scope(
            tenant=tenant,
            model=info.name,
            model_version=info.version,
            parameters={"top_k": str(top_k)},
        )
        response = gateway_pb2.PredictResponse(
            model=info.name,
            model_version=info.version,
            tenant=tenant,
            trace_id=current_trace_id(),
        )
        mode = cache_mode or common_pb2.CACHE_MODE_USE
        cache_on = info.cache.mode != "off"
        scope_t = scope_tuple(scope)
        key = exact_key(scope_t, text)
        if cache_on and mode == common_pb2.CACHE_MODE_USE:
            now = time.time()
            local = self.exact_tier.get(key, now)
            if local is not None:  # an exact repeat: no hop at all
                self.counters["cache_exact"] += 1
                self.counters["cache_exact_local"] += 1
                metrics.CACHE_OUTCOMES.labels(info.name, "exact").inc()
                response.cache.outcome = common_pb2.CACHE_OUTCOME_EXACT
                response.cache.similarity = 1.0
                response.cache.entry_id = key
                response.cache.age_s = max(0.0, now - local.created_at)
                response.cache.detail = LOCAL_DETAIL
                response.prediction.CopyFrom(local.prediction)
                return self._finish(response, timings, started)
        tokenizing = asyncio.ensure_future(
            call_hop(
                schema.SPAN_TOKENIZE,
                self.tokenizer.target,
                self.tokenizer.stub().Tokenize,
                tokenizer_pb2.TokenizeRequest(
                    model=info.name, model_version=info.version, texts=[text]
                ),
                timeout_s,
                timings,
            )
        )
        if cache_on and mode == common_pb2.CACHE_MODE_USE:
            hit = await self._lookup(scope, key, text, info, response.cache, timings)
            if hit is not None:
                _discard(tokenizing)
                response.prediction.CopyFrom(hit.prediction)
                return self._finish(response, timings, started)
            metrics.CACHE_OUTCOMES.labels(info.name, _outcome(response.cache.outcome)).inc()
        else:
            self.counters["cache_skipped"] += 1
            metrics.CACHE_OUTCOMES.labels(info.name, "skipped").inc()
            response.cache.outcome = common_pb2.CACHE_OUTCOME_SKIPPED
            response.cache.detail = (
                f"cache mode {info.cache.mode!r} for {info.name}"
                if not cache_on
                else f"request cache_mode {common_pb2.CacheMode.Name(mode)}"
            )

        async def infer() -> common_pb2.Prediction:
            self.counters["inferences"] += 1
            prediction = await self._infer(tokenizing, info, top_k, timeout_s, timings)
            if cache_on and mode != common_pb2.CACHE_MODE_BYPASS:
                self._maybe_store(scope, key, text, prediction, info)
            return prediction

        if mode == common_pb2.CACHE_MODE_USE:
            # Coalesce only plain misses: REFRESH and BYPASS ask for an inference of their own.
            waited = time.perf_counter()
            prediction, shared = await self.coalescer.run(key, infer)
            if shared:
                _discard(tokenizing)
                self.counters["coalesced"] += 1
                metrics.COALESCED.inc()
                response.cache.coalesced = True
                timings["coalesced_wait"] = (time.perf_counter() - waited) * 1e3
        else:
            prediction = await infer()
        response.prediction.CopyFrom(prediction)
        return self._finish(response, timings, started)

    async def _infer(
        self,
        tokenizing: asyncio.Future[Any],
        info: inference_pb2.ModelInfo,
        top_k: int,
        timeout_s: float,
        timings: dict[str, float],
    ) -> common_pb2.Prediction:
        tokens: tokenizer_pb2.TokenizeResponse = await tokenizing
        inferred: inference_pb2.InferResponse = await call_hop(
            schema.SPAN_INFERENCE,
            self.inference.target,
            self.inference.stub().Infer,
            inference_pb2.InferRequest(
                model=info.name,
                model_version=info.version,
                inputs=[tokens.input_ids, tokens.attention_mask],
                outputs=["logits"],
            ),
            timeout_s,
            timings,
        )
        timings["inference.queue"] = inferred.queue_ms
        timings["inference.compute"] = inferred.compute_ms
        post: postprocess_pb2.PostprocessResponse = await call_hop(
            schema.SPAN_POSTPROCESS,
            self.postprocess.target,
            self.postprocess.stub().Postprocess,
            postprocess_pb2.PostprocessRequest(
                model=info.name,
                model_version=info.version,
                outputs=inferred.outputs,
                top_k=top_k,
            ),
            timeout_s,
            timings,
        )
        return post.predictions[0]

    async def _lookup(
        self,
        scope: common_pb2.Scope,
        key: str,
        text: str,
        info: inference_pb2.ModelInfo,
        cache: gateway_pb2.CacheInfo,
        timings: dict[str, float],
    ) -> cache_pb2.LookupResponse | None:
        """The hit, or None after recording MISS or FAIL_OPEN in `cache`."""
        if not self.breaker.allow():
            self.counters["cache_fail_open"] += 1
            self.counters["cache_circuit_open"] += 1
            metrics.CACHE_FAIL_OPEN.labels("circuit_open").inc()
            cache.outcome = common_pb2.CACHE_OUTCOME_FAIL_OPEN
            cache.detail = (
                f"cache circuit open after repeated failures; retrying the cache in "
                f"{self.breaker.retry_in():.1f}s"
            )
            return None
        generation = self.exact_tier.generation
        try:
            found: cache_pb2.LookupResponse = await call_hop(
                schema.SPAN_CACHE_LOOKUP,
                self.cache.target,
                self.cache.stub().Lookup,
                cache_pb2.LookupRequest(
                    scope=scope, text=text, mode=info.cache.mode, threshold=info.cache.threshold
                ),
                self.config.cache_budget_ms / 1e3,
                timings,
            )
        except HopError as err:
            self.breaker.failure()
            self.counters["cache_fail_open"] += 1
            metrics.CACHE_FAIL_OPEN.labels(err.code.name.lower()).inc()
            cache.outcome = common_pb2.CACHE_OUTCOME_FAIL_OPEN
            cache.detail = err.message
            log.warning("cache fail-open", extra={"reason": err.message})
            return None
        self.breaker.success()
        if found.outcome in (common_pb2.CACHE_OUTCOME_EXACT, common_pb2.CACHE_OUTCOME_SEMANTIC):
            exact = found.outcome == common_pb2.CACHE_OUTCOME_EXACT
            self.counters["cache_exact" if exact else "cache_semantic"] += 1
            metrics.CACHE_OUTCOMES.labels(info.name, "exact" if exact else "semantic").inc()
            cache.outcome = found.outcome
            cache.similarity = found.similarity
            cache.entry_id = found.entry_id
            cache.age_s = found.age_s
            if exact and info.cache.ttl_s > 0:
                created = time.time() - found.age_s
                self.exact_tier.put(
                    key,
                    LocalEntry(
                        found.prediction,
                        scope_tuple(scope),
                        created,
                        created + info.cache.ttl_s,
                    ),
                    generation,
                )
            return found
        self.counters["cache_miss"] += 1
        cache.outcome = common_pb2.CACHE_OUTCOME_MISS
        return None

    def _maybe_store(
        self,
        scope: common_pb2.Scope,
        key: str,
        text: str,
        prediction: common_pb2.Prediction,
        info: inference_pb2.ModelInfo,
    ) -> None:
        policy = info.cache
        if (prediction.out_of_scope and not policy.store_out_of_scope) or (
            prediction.score < policy.min_score
        ):
            self.counters["stores_skipped_policy"] += 1
            return
        if self.breaker.state != "closed":
            return  # a failing cache gets no writes either; the probe lookup decides
        self._spawn(self._store(scope, key, text, prediction, info), name="store")

    async def _store(
        self,
        scope: common_pb2.Scope,
        key: str,
        text: str,
        prediction: common_pb2.Prediction,
        info: inference_pb2.ModelInfo,
    ) -> None:
        generation = self.exact_tier.generation
        try:
            await call_hop(
                schema.SPAN_CACHE_STORE,
                self.cache.target,
                self.cache.stub().Store,
                cache_pb2.StoreRequest(
                    scope=scope,
                    text=text,
                    prediction=prediction,
                    ttl_s=info.cache.ttl_s,
                    max_entries=info.cache.max_entries,
                    mode=info.cache.mode,
                ),
                2.0,
                {},
            )
            self.counters["stores"] += 1
            if info.cache.ttl_s > 0:
                now = time.time()
                self.exact_tier.put(
                    key,
                    LocalEntry(prediction, scope_tuple(scope), now, now + info.cache.ttl_s),
                    generation,
                )
        except HopError as err:
            self.counters["store_errors"] += 1
            log.warning("cache store failed", extra={"status": err.code.name})

    async def GetStats(
        self,
        request: gateway_pb2.GetStatsRequest,
        context: grpc.aio.ServicerContext[
            gateway_pb2.GetStatsRequest, gateway_pb2.GetStatsResponse
        ],
    ) -> gateway_pb2.GetStatsResponse:
        return gateway_pb2.GetStatsResponse(
            counters={
                **self.counters,
                "cache_circuit_opened": self.breaker.opened,
                "stores_in_flight": sum(t.get_name() == "store" for t in self._background),
                "coalescing_in_flight": len(self.coalescer),
                "local_exact_entries": len(self.exact_tier),
                "local_exact_live": int(self.exact_tier.live),
            },
            cache_circuit=self.breaker.state,
        )

    @staticmethod
    def _finish(
        response: gateway_pb2.PredictResponse, timings: dict[str, float], started: float
    ) -> gateway_pb2.PredictResponse:
        trace.get_current_span().set_attributes(
            {
                schema.MODEL: response.model,
                schema.MODEL_VERSION: response.model_version,
                schema.TENANT: response.tenant,
                schema.CACHE_OUTCOME: _outcome(response.cache.outcome),
                schema.CACHE_SIMILARITY: response.cache.similarity,
                schema.CACHE_COALESCED: response.cache.coalesced,
                schema.CACHE_LOCAL: response.cache.detail == LOCAL_DETAIL,
            }
        )
        timings["total"] = (time.perf_counter() - started) * 1e3
        response.timings.extend(common_pb2.HopTiming(hop=h, ms=ms) for h, ms in timings.items())
        return response


def _outcome(outcome: common_pb2.CacheOutcome.ValueType) -> str:
    return common_pb2.CacheOutcome.Name(outcome).removeprefix("CACHE_OUTCOME_").lower()


def _discard(task: asyncio.Future[Any]) -> None:
    """Cancel work whose answer is no longer needed, without an unretrieved-error warning."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
