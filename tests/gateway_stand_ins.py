"""Stand-ins for the gateway's upstreams, and a gateway over them, for the unit tests of its
prediction path (tests/unit/test_gateway_orchestration.py, test_gateway_speculation.py,
test_gateway_cache_path.py).

The tokenizer, cache, inference and postprocess are small in-process stand-ins for their gRPC
stubs, handed to GatewayService through GatewayUpstreams: no processes, no sockets. They
answer the way the real services do for these cases (a slow cache overruns the call's
deadline, a broken upstream raises the AioRpcError a channel would) and record what they
were asked. The real processes are covered by the mesh lane (tests/mesh/).

Counts are the test process's Prometheus counters, shared by every test, so each test
compares GetStats before and after (`changed`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
from servicer_context import AbortingContext

from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import GatewayService
from hopline.gateway.speculation import SpeculationMode
from hopline.gateway.upstream import GatewayUpstreams
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2

MODEL, UNCACHED, EXACT_ONLY = "intents", "intents-uncached", "intents-exact"
LABELS = ["refund", "delivery", "billing"]
MISS = common_pb2.CACHE_OUTCOME_MISS
EXACT = common_pb2.CACHE_OUTCOME_EXACT
SEMANTIC = common_pb2.CACHE_OUTCOME_SEMANTIC
FAIL_OPEN = common_pb2.CACHE_OUTCOME_FAIL_OPEN
SKIPPED = common_pb2.CACHE_OUTCOME_SKIPPED
STATS_KEYS = {
    "requests",
    "kserve_infer_requests",
    "streams",
    "kserve_streams",
    "inferences",
    "coalesced",
    "coalesced_reruns",
    "speculative_used",
    "speculative_wasted",
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
    "cache_circuit_opened",
    "stores_in_flight",
    "coalescing_in_flight",
    "local_exact_entries",
    "local_exact_live",
    "cache_known_miss",
    "key_mirror_keys",
    "key_mirror_synced",
}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What a grpc.aio stub raises when the call fails."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


def model(name: str, cache_mode: str) -> inference_pb2.ModelInfo:
    info = inference_pb2.ModelInfo(name=name, version="1", labels=LABELS, ready=True)
    info.cache.mode = cache_mode
    info.cache.threshold = 0.9
    info.cache.ttl_s = 600.0
    return info


class Tokenizer:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.error: grpc.aio.AioRpcError | None = None

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, **_: Any
    ) -> tokenizer_pb2.TokenizeResponse:
        self.texts.extend(request.texts)
        if self.error is not None:
            raise self.error
        width = len(request.texts[0].split())
        ids = common_pb2.Tensor(name="input_ids", shape=[1, width])
        mask = common_pb2.Tensor(name="attention_mask", shape=[1, width])
        return tokenizer_pb2.TokenizeResponse(input_ids=ids, attention_mask=mask)


class Inference:
    def __init__(self) -> None:
        self.requests: list[inference_pb2.InferRequest] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.gate: asyncio.Event | None = None  # when set, Infer waits for it

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, **_: Any
    ) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(
            models=[model(MODEL, "semantic"), model(UNCACHED, "off"), model(EXACT_ONLY, "exact")]
        )

    async def Infer(
        self, request: inference_pb2.InferRequest, **_: Any
    ) -> inference_pb2.InferResponse:
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        logits = common_pb2.Tensor(name="logits", shape=[1, len(LABELS)])
        return inference_pb2.InferResponse(outputs=[logits], queue_ms=1.5, compute_ms=4.0)


class Postprocess:
    def __init__(self) -> None:
        self.requests: list[postprocess_pb2.PostprocessRequest] = []

    async def Postprocess(
        self, request: postprocess_pb2.PostprocessRequest, **_: Any
    ) -> postprocess_pb2.PostprocessResponse:
        self.requests.append(request)
        top = [common_pb2.LabelScore(label=LABELS[i], score=0.8 - i / 10) for i in range(3)]
        prediction = common_pb2.Prediction(
            label="refund", score=0.8, top_k=top[: request.top_k or 1]
        )
        return postprocess_pb2.PostprocessResponse(predictions=[prediction])


Entry = tuple[common_pb2.Prediction, common_pb2.CacheOutcome.ValueType]


class Cache:
    """Answers lookups from what it was given or stored; can be slow or broken."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.lookups: list[cache_pb2.LookupRequest] = []
        self.stores: list[cache_pb2.StoreRequest] = []
        self.lookup_delay_s = 0.0
        self.lookup_error: grpc.aio.AioRpcError | None = None
        self.store_gate: asyncio.Event | None = None  # when set, Store waits for it
        self.listing: list[str] | None = None  # exact keys listed to a watch that asks
        self.store_batches: list[int] = []  # stores per StoreBatch call
        self.store_batch_error: grpc.aio.AioRpcError | None = None  # StoreBatch raises it

    async def Lookup(
        self,
        request: cache_pb2.LookupRequest,
        *,
        timeout: float,  # noqa: ASYNC109 - a grpc.aio stub's signature, honoured as its deadline
        **_: Any,
    ) -> cache_pb2.LookupResponse:
        self.lookups.append(request)
        if self.lookup_error is not None:
            raise self.lookup_error
        if self.lookup_delay_s > timeout:  # what the channel does at the call's deadline
            await asyncio.sleep(timeout)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        await asyncio.sleep(self.lookup_delay_s)
        if request.text not in self.entries:
            return cache_pb2.LookupResponse(outcome=MISS)
        prediction, outcome = self.entries[request.text]
        similarity = 1.0 if outcome == EXACT else 0.93
        return cache_pb2.LookupResponse(
            outcome=outcome, prediction=prediction, similarity=similarity, entry_id="e-1", age_s=2
        )

    async def Store(self, request: cache_pb2.StoreRequest, **_: Any) -> cache_pb2.StoreResponse:
        if self.store_gate is not None:
            await self.store_gate.wait()
        self.stores.append(request)
        self.entries[request.text] = (request.prediction, EXACT)
        return cache_pb2.StoreResponse(entry_id="e-2")

    async def StoreBatch(
        self, request: cache_pb2.StoreBatchRequest, **_: Any
    ) -> cache_pb2.StoreBatchResponse:
        self.store_batches.append(len(request.stores))
        if self.store_batch_error is not None:
            raise self.store_batch_error
        results = []
        for store in request.stores:
            if store.text.startswith("refuse"):  # refused alone, as the cache refuses a store
                refused = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                results.append(cache_pb2.StoreResult(code=refused, message="too many stores"))
                continue
            reply = await self.Store(store)
            results.append(cache_pb2.StoreResult(entry_id=reply.entry_id))
        return cache_pb2.StoreBatchResponse(results=results)

    async def WatchInvalidations(
        self, request: cache_pb2.WatchInvalidationsRequest
    ) -> AsyncIterator[cache_pb2.WatchInvalidationsResponse]:
        yield cache_pb2.WatchInvalidationsResponse(live=True)
        if request.keys and self.listing is not None:
            scope = common_pb2.Scope(tenant="default", model=EXACT_ONLY, model_version="1")
            held = cache_pb2.HeldKeys(scope=scope, entry_ids=self.listing)
            yield cache_pb2.WatchInvalidationsResponse(held=[held])
            yield cache_pb2.WatchInvalidationsResponse(keys_synced=True)
        await asyncio.Event().wait()  # live until the gateway stops


@dataclasses.dataclass
class StandIn:
    """One upstream as GatewayUpstreams holds it: an address and a stub per call."""

    target: str
    _stub: object
    closed: bool = False

    def stub(self) -> Any:
        return self._stub

    async def close(self) -> None:
        self.closed = True


@dataclasses.dataclass
class Mesh:
    gateway: GatewayService
    tokenizer: Tokenizer
    cache: Cache
    inference: Inference
    postprocess: Postprocess

    async def predict(
        self,
        text: str,
        model: str = MODEL,
        cache_mode: common_pb2.CacheMode.ValueType = common_pb2.CACHE_MODE_USE,
    ) -> gateway_pb2.PredictResponse:
        request = gateway_pb2.PredictRequest(text=text, model=model, cache_mode=cache_mode)
        return await self.gateway.answer(request, (), timeout_s=2.0)

    async def stats(self) -> gateway_pb2.GetStatsResponse:
        context = cast(Any, AbortingContext())
        return await self.gateway.GetStats(gateway_pb2.GetStatsRequest(), context)

    async def counters(self) -> dict[str, int]:
        return dict((await self.stats()).counters)

    async def settle(self) -> None:
        """Until the stores the gateway scheduled have landed (as tests/harness.py waits);
        they linger HOPLINE_GATEWAY_STORE_LINGER_MS before they are sent. A store is
        scheduled once its reply is on its way (the loop's next turn): a client over gRPC
        has its reply only after that turn, `predict` here at once, so the loop turns first."""
        await asyncio.sleep(0)
        for _ in range(1000):
            if not (await self.counters())["stores_in_flight"]:
                return
            await asyncio.sleep(0.002)
        raise AssertionError("stores still in flight")


def changed(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def run(
    scenario: Callable[[Mesh], Awaitable[None]], listing: list[str] | None = None, **config: Any
) -> None:
    """Start a gateway over fresh stand-ins, run the scenario against it, stop it. The cache
    lists `listing`'s keys to a watch that asks for keys."""

    async def main() -> None:
        tokenizer, cache, inference, postprocess = Tokenizer(), Cache(), Inference(), Postprocess()
        cache.listing = listing
        stand_ins = [
            StandIn(f"{name}.test:1", stub)
            for name, stub in [
                ("tokenizer", tokenizer),
                ("cache", cache),
                ("inference", inference),
                ("postprocess", postprocess),
            ]
        ]
        upstreams = GatewayUpstreams(*stand_ins)
        settings: dict[str, Any] = {
            "default_model": MODEL,
            "local_exact_entries": 0,
            # The stand-in cache lists no keys unless a test gives it some (`listing`).
            "key_mirror_keys": 0,
            "cache_budget_ms": 20.0,
            "cache_breaker_failures": 2,
            "cache_breaker_cooldown_s": 60.0,
            "model_refresh_s": 3600.0,
            # Lookup, then model: the order most tests pin down; test_gateway_speculation.py
            # turns speculation on.
            "speculate": SpeculationMode.OFF,
            **config,
        }
        gateway = GatewayService(GatewayConfig(**settings), upstreams)
        async with asyncio.timeout(5):
            await gateway.start()
            try:
                await scenario(Mesh(gateway, tokenizer, cache, inference, postprocess))
            finally:
                await gateway.stop()
        assert all(s.closed for s in stand_ins)  # stop() closed every upstream

    asyncio.run(main())


def hops(reply: gateway_pb2.PredictResponse) -> list[str]:
    return [t.hop for t in reply.timings]
