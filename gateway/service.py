"""hopline.gateway.v1.GatewayService: validates, resolves the model, and runs the hops.

Two APIs share one prediction path: the gateway's own Predict and the KServe v2 ModelInfer
(hopline.gateway.open_inference), which validate, resolve the tenant and the model, and run
`predict_text` per text.

`predict_text` reads as its steps, the cache's in gateway/cache_path.py (`cache`) and the
model's in gateway/model_path.py (`model`):
1. `cache.local_answer`: an exact repeat the gateway holds is answered with no hop.
2. `cache.known_miss` may vouch the cache does not hold the key (no lookup); else
   `model.tokenize_early` starts, `model.speculate` may start the inference too
   (gateway/speculation.py says when), and `cache.look_up` runs meanwhile (the lookup needs
   no token ids).
3. `cache.record_outcome`: the one place a request's cache outcome is counted.
4. On a miss, `model.infer_once` (or the speculative one, already running): tokenize ->
   infer -> postprocess, shared by identical concurrent misses; then `cache.store_later`
   (fire-and-forget, after the model's cache policy). On a hit, the speculative inference is
   cancelled, or kept for `_verify` where the cache asked for the model's answer.
5. `_finish`: span attributes and timings on the reply.
The cache never makes the mesh less available: a lookup that fails or overruns its budget is
reported as FAIL_OPEN and the request goes on to inference, and a circuit breaker stops
calling a failing cache for a cool-down.

Counts live in Prometheus (hopline.observability.metrics), one per process; GetStats reads
them, so a scrape and GetStats cannot disagree.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, cast

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from hopline.gateway.admission import Admission
from hopline.gateway.cache_path import CachePath, outcome_name
from hopline.gateway.cache_writes import CacheWrites, spawn
from hopline.gateway.call import PredictCall, check_cache_mode, discard
from hopline.gateway.catalogue import ModelCatalogue
from hopline.gateway.config import GatewayConfig
from hopline.gateway.errors import RequestError, abort
from hopline.gateway.exact_tier import LocalExactTier
from hopline.gateway.identity import IdentityError, KeyFirst, TenantResolver
from hopline.gateway.key_mirror import KeyMirror
from hopline.gateway.model_path import ModelPath
from hopline.gateway.open_streams import OpenStreams
from hopline.gateway.resilience import CircuitBreaker, CircuitState, Coalescer
from hopline.gateway.speculation import Speculation
from hopline.gateway.stage_batching import GatewayStages
from hopline.gateway.streaming import predict_stream
from hopline.gateway.upstream import GatewayUpstreams, HopError
from hopline.model.repository import validate_name
from hopline.observability import metrics, schema
from hopline.observability.logs import Episodes
from hopline.observability.loop_metrics import LoopCounter
from hopline.observability.tracing import untraced
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.runtime.config import SettingError
from hopline.runtime.errors import ECHO_CHARS, StatusError, clip
from hopline.runtime.interceptors import RpcWrapper
from hopline.runtime.service_table import ServiceName

log = logging.getLogger("hopline.gateway")
# A served semantic hit's model run that failed: once an episode, as the model's hops are.
VERIFY_FAILURES = Episodes(log, "verification inference failed")
# While inference starts (listening, NOT_SERVING), the gateway asks for its models this
# often: the launcher starts the gateway beside its upstreams, so this is its last step.
INFERENCE_POLL_S = 0.1
WAIT_SAID_EVERY_S = 5.0  # "waiting for inference" logged at most this often
VERIFICATIONS = "verifications"
# A confirmation the cache waits for (cache/watch_feed.py:ACK_WAIT_S): past it, it cuts the
# watch off instead.
ACK_TIMEOUT_S = 1.0

Context = grpc.aio.ServicerContext[gateway_pb2.PredictRequest, gateway_pb2.PredictResponse]


# GetStats counter -> the Prometheus counter it reads and the labels it is summed over.
COUNTS: dict[str, tuple[Counter | LoopCounter, dict[str, str]]] = {
    "requests": (metrics.GATEWAY_REQUESTS, {}),
    "kserve_infer_requests": (metrics.GATEWAY_CALLS, {"method": "ModelInfer"}),
    "streams": (metrics.GATEWAY_CALLS, {"method": "PredictStream"}),
    "kserve_streams": (metrics.GATEWAY_CALLS, {"method": "ModelStreamInfer"}),
    "inferences": (metrics.INFERENCES, {}),
    "coalesced": (metrics.COALESCED, {}),
    "coalesced_reruns": (metrics.COALESCED_RERUN, {}),
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


# Of a client's deadline, the gateway keeps this share (at most the max) to send its answer:
# its event loop may be late by that much on a busy machine (at 5%, at most 10 ms, 2 of 8
# answers to a 450 ms deadline still came too late with the machine's load at 17).
REPLY_MARGIN_SHARE = 0.1
REPLY_MARGIN_MAX_S = 0.05


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
        self.stream_drain = asyncio.Event()  # set by drain(): PredictStreams stop reading
        self.breaker = CircuitBreaker(
            config.cache_breaker_failures, config.cache_breaker_cooldown_s
        )
        breaker = self.breaker  # read at each scrape: open turns half-open with time alone
        metrics.CACHE_CIRCUIT_OPEN.set_function(lambda: float(breaker.state != CircuitState.CLOSED))
        self.coalescer: Coalescer[common_pb2.Prediction] = Coalescer()
        self.speculation = Speculation(config.speculate, config.speculate_max_hit_rate)
        self.stages = (
            GatewayStages.over(
                self.upstreams,
                config.batch_in_flight,
                config.batch_max_rows,
                self._model_rows,
                (lambda: self.admission.in_flight > 1) if config.batch_gather else None,
                config.batch_linger_ms / 1e3,
                config.upstream_hedge_attempts,
                config.upstream_hedge_min_ms / 1e3,
            )
            if config.batch_max_rows > 1
            else None
        )
        self.admission = Admission(
            config.max_in_flight,
            config.cache_budget_ms,
            config.cache_adaptive,
            tenant_min_in_flight=config.tenant_min_in_flight,
            cap_s=config.upstream_timeout_s,
        )
        self.streams = OpenStreams(config.max_streams)
        self.exact_tier = LocalExactTier(config.local_exact_entries)
        self.key_mirror = KeyMirror(config.key_mirror_keys)
        self._loops: set[asyncio.Task[None]] = set()  # run for the life of the process
        self.writes = CacheWrites(
            self.upstreams.cache,
            batched=self.stages is not None,
            linger_s=config.store_linger_ms / 1e3,
            in_flight=config.batch_in_flight,
        )
        self.cache_path = CachePath(
            config,
            self.upstreams.cache,
            self.admission,
            self.breaker,
            self.exact_tier,
            self.key_mirror,
            self.speculation,
            self.writes,
        )
        self.model_path = ModelPath(
            self.upstreams, self.stages, self.coalescer, self.speculation, self.cache_path
        )

    def rpc_wrappers(self) -> list[RpcWrapper]:
        """Wrappers of the gateway's own, inside the runtime's (runtime/server.py)."""
        return [KeyFirst(self.tenants)]

    def register(self, server: grpc.aio.Server) -> None:
        # Imported here: the KServe servicer builds on this module's GatewayService.
        from hopline.gateway.open_inference import OpenInferenceService

        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(self, server)
        OpenInferenceService(self).register(server)

    def co_located(self) -> set[ServiceName]:
        """The upstream services running in this process (their metrics are this one's)."""
        return self.upstreams.co_located()

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        problems = self.config.address_problems()
        try:  # every request naming no model got NOT_FOUND "unknown model ''" (a settings probe)
            validate_name(self.config.default_model)
        except ValueError as exc:
            problems.append(f"HOPLINE_DEFAULT_MODEL: {exc}")
        if problems:
            raise SettingError("; ".join(problems))
        # Not SERVING until co-located services are, and inference has said which models exist.
        await self.upstreams.start()
        said_at = -math.inf
        while True:  # an address naming another service is said by Upstream.check_serves
            try:
                with untraced():  # no request's work: no root trace of its own
                    await self.catalogue.refresh()
                break
            except grpc.aio.AioRpcError as err:
                if time.monotonic() - said_at >= WAIT_SAID_EVERY_S:
                    said_at = time.monotonic()
                    log.info(
                        "waiting for inference",
                        extra={
                            "target": self.upstreams.inference.target,
                            "status": err.code().name,
                        },
                    )
                await asyncio.sleep(INFERENCE_POLL_S)
        log.info("models", extra={"models": sorted(f"{n}/{v}" for n, v in self.models)})
        spawn(self.catalogue.follow(self.config.model_refresh_s), self._loops)
        if self.exact_tier.capacity > 0 or self.key_mirror.capacity > 0:
            spawn(
                self.exact_tier.follow(
                    self._watch_cache, self.key_mirror, ack=self._ack_invalidations
                ),
                self._loops,
            )
        self.serving = True

    def _model_rows(self, name: str, version: str) -> int:
        info = self.models.get((name, version))
        return info.max_batch_size if info is not None else 0

    def _watch_cache(self) -> AsyncIterable[cache_pb2.WatchInvalidationsResponse]:
        return self.upstreams.cache.stub().WatchInvalidations(
            cache_pb2.WatchInvalidationsRequest(
                keys=self.key_mirror.capacity > 0, heartbeats=True, acks=True
            )
        )

    async def _ack_invalidations(self, watch_id: str, sequence: int) -> None:
        await self.upstreams.cache.stub().AckInvalidations(
            cache_pb2.AckInvalidationsRequest(watch_id=watch_id, sequence=sequence),
            timeout=ACK_TIMEOUT_S,
        )

    async def drain(self) -> None:
        """Once the drain delay is over: every PredictStream stops reading, answers what it
        read and ends UNAVAILABLE (gateway/streaming.py), not held open for the grace."""
        self.stream_drain.set()

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

    async def resolve_model(
        self, name: str, version: str, timeout_s: float | None = None
    ) -> inference_pb2.ModelInfo:
        """`timeout_s`: the caller's deadline for a re-read of the model list (default
        HOPLINE_UPSTREAM_TIMEOUT_S)."""
        wait_s = self.config.upstream_timeout_s if timeout_s is None else timeout_s
        try:
            return await self.catalogue.resolve(name, version, wait_s)
        except RequestError as err:
            if err.code != grpc.StatusCode.NOT_FOUND or max(len(name), len(version)) <= ECHO_CHARS:
                raise
            # The catalogue's message echoes the name whole: say it again, clipped.
            wanted = f"{clip(name)}/{clip(version)}" if version else clip(name)
            raise RequestError(err.code, self.catalogue.not_found(name, version, wanted)) from None

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
                f"{where} is {size} bytes; the limit is {self.config.max_text_bytes} "
                "(HOPLINE_MAX_TEXT_BYTES)",
            )

    def timeout_for(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """The request's budget: the gateway's cap, or the client's deadline less a margin,
        so that the gateway's own DEADLINE_EXCEEDED, naming the hop that ran out and
        carrying the trace id, reaches the client before the client's timer ends the call
        with gRPC's bare "Deadline Exceeded" (it lost that race in most of ~400 probes)."""
        # grpc returns None without a deadline, whatever the stubs say.
        remaining = cast("float | None", context.time_remaining())
        if remaining is None or remaining >= self.config.upstream_timeout_s:
            return self.config.upstream_timeout_s
        return float(remaining) - min(REPLY_MARGIN_MAX_S, REPLY_MARGIN_SHARE * float(remaining))

    # -- RPCs -----------------------------------------------------------------------------

    async def Predict(
        self, request: gateway_pb2.PredictRequest, context: Context
    ) -> gateway_pb2.PredictResponse:
        metadata = context.invocation_metadata() or ()
        try:
            return await self.answer(request, metadata, self.timeout_for(context))
        except StatusError as err:
            self._describe_failure(request, metadata)
            await abort(context, err)

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
            request.model or self.config.default_model, request.model_version, timeout_s
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
        cache, model = self.cache_path, self.model_path
        speculative: asyncio.Future[tuple[common_pb2.Prediction, bool]] | None = None
        prediction = cache.local_answer(call)
        if prediction is not None:  # a repeat this gateway holds: nothing to admit or run
            cache.record_outcome(call)
            return self._finish(call, prediction)
        # Refused at once (a RequestError) past the in-flight limit or the deadline's reach.
        with self.admission.admit(call):
            try:
                if not cache.known_miss(call):
                    if call.use_cache and not cache.expects_embedding(call):
                        model.tokenize_early(call)  # beside the lookup
                    speculative = model.speculate(call)
                    prediction = await cache.look_up(call)
                cache.record_outcome(call)
                if prediction is None:
                    prediction, ran_here = await (speculative or model.infer_once(call))
                    if ran_here and call.may_store:
                        cache.store_later(call, prediction)
                    elif ran_here and call.wants_store:  # its stages' files differ
                        metrics.CACHE_STORES.labels("skipped_files_differ").inc()
                    self.writes.report(call, prediction)
                elif call.verify_id:  # the cache wants the model's answer too, after the reply
                    self.writes.spawn(self._verify(call, speculative))
                else:
                    call.drop_tokens()
                    if speculative is not None:
                        discard(speculative)
                        metrics.SPECULATIVE.labels("wasted").inc()
            except BaseException:
                # Cancelled (the caller went) or failed: the early tokenize and a speculative
                # run go too. Left, they ran on for nobody, and their failures were logged
                # "Task exception was never retrieved" (a fuzzing probe: 486 in a run).
                call.drop_tokens()
                if speculative is not None:
                    discard(speculative)
                raise
        return self._finish(call, prediction)

    async def _verify(
        self,
        call: PredictCall,
        speculative: asyncio.Future[tuple[common_pb2.Prediction, bool]] | None,
    ) -> None:
        """The model's answer for a served semantic hit, reported to the cache (after the
        reply: the cached answer is never delayed by it). A speculative run is reused."""
        call.renew(self.config.upstream_timeout_s)  # the caller's deadline is for its reply
        try:
            if speculative is not None:
                prediction, _ = await speculative
            else:
                prediction = await self.model_path.tokenize_infer_postprocess(call)
        except HopError as err:
            VERIFY_FAILURES.failed(VERIFICATIONS, err.code.name, status=err.code.name)
            return
        VERIFY_FAILURES.ended(VERIFICATIONS)
        await self.writes.send_report(call, prediction)

    def _describe_failure(
        self, request: gateway_pb2.PredictRequest, metadata: Iterable[tuple[str, str | bytes]]
    ) -> None:
        """A failed Predict's span says whose and which model's it was, as a served one's
        does (`_finish`): a tenant's or a version's failures could not be searched for in
        Jaeger (a tracing probe). What was asked, and the tenant when the caller is known."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        try:
            tenant = self.tenants.resolve(request.tenant, metadata)
        except StatusError:
            tenant = ""  # not known: its failure is that
        span.set_attributes(
            {
                schema.MODEL: clip(request.model or self.config.default_model),
                schema.MODEL_VERSION: clip(request.model_version),
                schema.TENANT: tenant,
            }
        )

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
                    schema.CACHE_OUTCOME: outcome_name(response.cache.outcome),
                    schema.CACHE_SIMILARITY: response.cache.similarity,
                    schema.CACHE_COALESCED: response.cache.coalesced,
                    schema.CACHE_LOCAL: call.local,
                    schema.CACHE_KNOWN_MISS: call.known_miss,
                    schema.SPECULATIVE: call.speculative,
                    schema.CACHE_EMBEDDING_USED: call.embedding is not None,
                }
            )
        call.timings["total"] = (time.perf_counter() - call.started) * 1e3
        # Added in place: half the time of building the messages and extending (in a loop).
        add = response.timings.add
        for hop, ms in call.timings.items():
            add(hop=hop, ms=ms)
        return response
