"""The gateway's prediction path, in-process: a real GatewayService over stand-in upstreams.

The tokenizer, cache, inference and postprocess are small in-process stand-ins for their gRPC
stubs, handed to GatewayService through GatewayUpstreams: no processes, no sockets. They
answer the way the real services do for these cases (a slow cache overruns the call's
deadline, a broken upstream raises the AioRpcError a channel would) and record what they
were asked. The real processes are covered by the mesh lane (tests/mesh/).

Counts are this process's Prometheus counters, shared by every test here, so each test
compares GetStats before and after.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
import pytest
from servicer_context import Aborted, AbortingContext

from conftest import until
from hopline.cache.keys import exact_key, scope_tuple
from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import GatewayService
from hopline.gateway.speculation import Speculation, SpeculationMode
from hopline.gateway.upstream import GatewayUpstreams, HopError
from hopline.observability import metrics
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2
from hopline.runtime.errors import StatusError

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
    "inferences",
    "coalesced",
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
        they linger HOPLINE_GATEWAY_STORE_LINGER_MS before they are sent."""
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
            # Lookup, then model: the order most tests here pin down; the speculation tests
            # at the end turn it on.
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


# ---------------------------------------------------------------------------------------------


def test_a_miss_runs_tokenize_infer_postprocess_then_stores_after_the_reply() -> None:
    text = "where is my parcel"

    async def scenario(m: Mesh) -> None:
        m.cache.store_gate = asyncio.Event()
        before = await m.counters()
        reply = await m.predict(text)
        assert reply.cache.outcome == MISS
        assert reply.prediction.label == "refund"
        assert (reply.model, reply.model_version, reply.tenant) == (MODEL, "1", "default")
        assert m.tokenizer.texts == [text]
        [infer] = m.inference.requests
        assert [t.name for t in infer.inputs] == ["input_ids", "attention_mask"]
        assert list(infer.inputs[0].shape) == [1, 4]  # the tokenizer's ids reached inference
        [post] = m.postprocess.requests
        assert [t.name for t in post.outputs] == ["logits"]  # inference's outputs reached it
        assert post.top_k == 1
        assert sorted(hops(reply)) == sorted(
            [
                "tokenize",
                "cache_lookup",
                "inference",
                "inference.queue",
                "inference.compute",
                "postprocess",
                "total",
            ]
        )
        # The store is scheduled, not awaited: it lands after the reply.
        assert (await m.counters())["stores_in_flight"] == 1
        assert m.cache.stores == []
        m.cache.store_gate.set()
        await m.settle()
        [store] = m.cache.stores
        assert (store.text, store.scope.tenant, store.scope.model) == (text, "default", MODEL)
        assert store.scope.parameters["top_k"] == "1"
        assert store.ttl_s == 600.0
        assert changed(before, await m.counters()) == {
            "requests": 1,
            "cache_miss": 1,
            "inferences": 1,
            "stores": 1,
        }

    run(scenario)


@pytest.mark.parametrize("outcome", [EXACT, SEMANTIC])
def test_a_cache_hit_short_circuits_inference(outcome: common_pb2.CacheOutcome.ValueType) -> None:
    text = "I want my money back"

    async def scenario(m: Mesh) -> None:
        m.cache.entries[text] = (common_pb2.Prediction(label="billing", score=0.7), outcome)
        before = await m.counters()
        reply = await m.predict(text)
        assert reply.cache.outcome == outcome
        assert reply.prediction.label == "billing"
        assert (reply.cache.entry_id, reply.cache.age_s) == ("e-1", 2.0)
        assert m.inference.requests == []
        assert m.postprocess.requests == []
        assert "inference" not in hops(reply)
        await m.settle()
        assert m.cache.stores == []
        name = "cache_exact" if outcome == EXACT else "cache_semantic"
        assert changed(before, await m.counters()) == {"requests": 1, name: 1}

    run(scenario)


@pytest.mark.parametrize(
    ("mode", "stores"),
    [(common_pb2.CACHE_MODE_BYPASS, 0), (common_pb2.CACHE_MODE_REFRESH, 1)],
)
def test_bypass_and_refresh_skip_the_lookup_and_only_refresh_stores(
    mode: common_pb2.CacheMode.ValueType, stores: int
) -> None:
    text = "cancel my order"

    async def scenario(m: Mesh) -> None:
        m.cache.entries[text] = (common_pb2.Prediction(label="billing"), EXACT)
        before = await m.counters()
        reply = await m.predict(text, cache_mode=mode)
        assert reply.cache.outcome == SKIPPED
        assert reply.cache.detail == f"request cache_mode {common_pb2.CacheMode.Name(mode)}"
        assert reply.prediction.label == "refund"  # from inference, not the stored entry
        assert m.cache.lookups == []
        assert len(m.inference.requests) == 1
        await m.settle()
        assert len(m.cache.stores) == stores
        expected = {"requests": 1, "cache_skipped": 1, "inferences": 1}
        assert changed(before, await m.counters()) == expected | ({"stores": 1} if stores else {})

    run(scenario)


def test_a_model_without_a_cache_never_touches_it() -> None:
    async def scenario(m: Mesh) -> None:
        reply = await m.predict("hello", model=UNCACHED)
        assert reply.cache.outcome == SKIPPED
        assert reply.cache.detail == f"cache mode 'off' for {UNCACHED}"
        await m.settle()
        assert (m.cache.lookups, m.cache.stores) == ([], [])

    run(scenario)


def test_a_slow_cache_fails_open_to_inference_and_the_breaker_counts_it() -> None:
    async def scenario(m: Mesh) -> None:
        m.cache.lookup_delay_s = 1.0  # far past the 20 ms budget
        before = await m.counters()
        overruns = metrics.count(metrics.CACHE_FAIL_OPEN, reason="deadline_exceeded")

        first = await m.predict("is my order late")
        assert first.cache.outcome == FAIL_OPEN
        assert first.cache.detail == "deadline exceeded waiting for the cache_lookup service"
        assert first.prediction.label == "refund"  # inference answered
        assert m.gateway.breaker.state == "closed"  # one failure of the two allowed
        await m.settle()
        assert len(m.cache.stores) == 1  # the circuit is still closed: writes go on

        second = await m.predict("is my order late again")
        assert second.cache.outcome == FAIL_OPEN
        assert (await m.stats()).cache_circuit == "open"
        await m.settle()
        assert len(m.cache.stores) == 1  # an open circuit gets no writes

        third = await m.predict("is my order very late")
        assert third.cache.outcome == FAIL_OPEN
        assert third.cache.detail.startswith("cache circuit open after repeated failures")
        assert len(m.cache.lookups) == 2  # the open circuit skipped the third lookup
        assert len(m.inference.requests) == 3
        after = await m.counters()
        assert changed(before, after) == {
            "requests": 3,
            "inferences": 3,
            "cache_fail_open": 3,
            "cache_circuit_open": 1,
            "cache_circuit_opened": 1,
            "stores": 1,
        }
        assert metrics.count(metrics.CACHE_FAIL_OPEN, reason="deadline_exceeded") == overruns + 2

    run(scenario)


def test_a_broken_cache_fails_open_with_the_reason() -> None:
    async def scenario(m: Mesh) -> None:
        m.cache.lookup_error = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        unavailable = metrics.count(metrics.CACHE_FAIL_OPEN, reason="unavailable")
        reply = await m.predict("where is my refund")
        assert reply.cache.outcome == FAIL_OPEN
        # The hop is named, its address is not (that goes to the log and the span).
        assert reply.cache.detail == "cache_lookup service unavailable"
        assert reply.prediction.label == "refund"
        assert metrics.count(metrics.CACHE_FAIL_OPEN, reason="unavailable") == unavailable + 1

    run(scenario)


@pytest.mark.parametrize(
    ("where", "code", "status", "message"),
    [
        (
            "inference",
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNAVAILABLE,
            "inference service unavailable",
        ),
        (
            "inference",
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INTERNAL,
            "inference failed with FAILED_PRECONDITION: socket closed",
        ),
        (
            "tokenizer",
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.INVALID_ARGUMENT,
            "tokenize: socket closed",
        ),
    ],
)
def test_an_upstream_error_ends_the_request_with_its_mapped_status(
    where: str, code: grpc.StatusCode, status: grpc.StatusCode, message: str
) -> None:
    async def scenario(m: Mesh) -> None:
        failing = m.inference if where == "inference" else m.tokenizer
        failing.error = rpc_error(code, "socket closed")
        with pytest.raises(StatusError) as caught:
            await m.predict("change my address")
        assert isinstance(caught.value, HopError)
        assert (caught.value.code, caught.value.message) == (status, message)
        # Predict turns it into that status for the caller.
        context = AbortingContext()
        with pytest.raises(Aborted):
            await m.gateway.Predict(
                gateway_pb2.PredictRequest(text="change my address"), cast(Any, context)
            )
        assert context.aborted == (status, message)

    run(scenario)


def test_identical_concurrent_misses_share_one_inference() -> None:
    text = "my card was declined"

    async def scenario(m: Mesh) -> None:
        m.inference.gate = asyncio.Event()
        before = await m.counters()
        callers = [asyncio.create_task(m.predict(text)) for _ in range(3)]
        await until(lambda: len(m.inference.requests) == 1 and m.gateway.coalescer.coalesced == 2)
        assert (await m.counters())["coalescing_in_flight"] == 1
        m.inference.gate.set()
        replies = await asyncio.gather(*callers)
        assert [r.prediction.label for r in replies] == ["refund"] * 3
        assert sorted(r.cache.coalesced for r in replies) == [False, True, True]
        assert all("coalesced_wait" in hops(r) for r in replies if r.cache.coalesced)
        await m.settle()
        assert len(m.cache.stores) == 1  # one inference, one store
        assert changed(before, await m.counters()) == {
            "requests": 3,
            "cache_miss": 3,
            "inferences": 1,
            "coalesced": 2,
            "stores": 1,
        }

    run(scenario)


def test_getstats_counts_each_outcome_once_from_the_prometheus_counters() -> None:
    text = "reset my password"

    def outcome(name: str) -> int:
        return metrics.count(metrics.CACHE_OUTCOMES, model=MODEL, outcome=name)

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.exact_tier.live)
        stats = await m.stats()
        assert set(stats.counters) == STATS_KEYS
        assert stats.cache_circuit == "closed"
        before = await m.counters()
        prometheus = {name: outcome(name) for name in ("exact", "miss", "skipped")}

        miss = await m.predict(text)
        await m.settle()  # stored, and copied to the gateway's local tier
        repeat = await m.predict(text)
        skipped = await m.predict(text, cache_mode=common_pb2.CACHE_MODE_BYPASS)

        assert (miss.cache.outcome, repeat.cache.outcome) == (MISS, EXACT)
        assert repeat.cache.detail == "answered by the gateway's local exact tier"
        assert "cache_lookup" not in hops(repeat)
        assert "tokenize" not in hops(repeat)
        assert len(m.cache.lookups) == 1  # the repeat made no hop at all
        assert skipped.cache.outcome == SKIPPED
        assert changed(before, await m.counters()) == {
            "requests": 3,
            "cache_miss": 1,
            "cache_exact": 1,
            "cache_exact_local": 1,
            "cache_skipped": 1,
            "inferences": 2,
            "stores": 1,
            "local_exact_entries": 1,
        }
        # GetStats and a scrape read the same counters: each outcome was counted once.
        assert {name: outcome(name) - n for name, n in prometheus.items()} == {
            "exact": 1,
            "miss": 1,
            "skipped": 1,
        }

    run(scenario, local_exact_entries=100)


def test_store_policy_skips_low_scores() -> None:
    async def scenario(m: Mesh) -> None:
        m.gateway.catalogue.models[(MODEL, "1")].cache.min_score = 0.9  # above the 0.8 answer
        before = await m.counters()
        await m.predict("a vague question")
        await m.settle()
        assert m.cache.stores == []
        assert changed(before, await m.counters()) == {
            "requests": 1,
            "cache_miss": 1,
            "inferences": 1,
            "stores_skipped_policy": 1,
        }

    run(scenario)


# -- speculation: the model started beside the lookup ------------------------------------------


def test_a_speculative_miss_overlaps_the_lookup_and_stores_once() -> None:
    text = "my parcel never came"

    async def scenario(m: Mesh) -> None:
        m.cache.lookup_delay_s = 0.01  # within the 20 ms budget
        before = await m.counters()
        reply = asyncio.ensure_future(m.predict(text))
        # The model is asked while the lookup is still on its way.
        await until(lambda: len(m.inference.requests) == 1)
        assert not reply.done()
        assert (await reply).cache.outcome == MISS
        await m.settle()
        assert [s.text for s in m.cache.stores] == [text]
        assert changed(before, await m.counters()) == {
            "requests": 1,
            "cache_miss": 1,
            "inferences": 1,
            "speculative_used": 1,
            "stores": 1,
        }

    run(scenario, speculate=SpeculationMode.ON)


def test_a_hit_cancels_the_speculative_inference_and_stores_nothing() -> None:
    text = "refund please"
    cached = common_pb2.Prediction(label="billing", score=0.9)

    async def scenario(m: Mesh) -> None:
        m.cache.entries[text] = (cached, SEMANTIC)
        m.cache.lookup_delay_s = 0.01
        m.inference.gate = asyncio.Event()  # the model never answers: only a cancel ends it
        before = await m.counters()
        reply = await m.predict(text)
        assert reply.cache.outcome == SEMANTIC
        assert reply.prediction.label == "billing"
        assert len(m.inference.requests) == 1  # it was started...
        await until(lambda: len(m.gateway.coalescer) == 0)  # ...and cancelled: no waiter left
        await m.settle()
        assert m.cache.stores == []
        assert changed(before, await m.counters()) == {
            "requests": 1,
            "cache_semantic": 1,
            "inferences": 1,
            "speculative_wasted": 1,
        }

    run(scenario, speculate=SpeculationMode.ON)


def test_auto_speculation_stops_while_lookups_keep_hitting() -> None:
    async def scenario(m: Mesh) -> None:
        for i in range(20):
            m.cache.entries[f"seen {i}"] = (common_pb2.Prediction(label="billing"), EXACT)
            await m.predict(f"seen {i}")
        before = await m.counters()
        assert (await m.predict("never seen")).cache.outcome == MISS
        await m.settle()
        assert changed(before, await m.counters()) == {
            "requests": 1,
            "cache_miss": 1,
            "inferences": 1,
            "stores": 1,
        }

    run(scenario, speculate=SpeculationMode.AUTO, speculate_max_hit_rate=0.2)


def test_the_hit_rate_rule_starts_and_stops_speculation_per_model() -> None:
    policy = Speculation(SpeculationMode.AUTO, max_hit_rate=0.2, window=10)
    assert policy.should("a")  # nothing known: the lookup is as likely a miss
    for _ in range(3):
        policy.record("a", hit=True)
    assert not policy.should("a")  # 1 - 0.9**3 = 0.27 of recent lookups hit
    assert policy.should("b")  # another model's hits say nothing about this one
    for _ in range(5):
        policy.record("a", hit=False)
    assert policy.should("a")  # 0.27 * 0.9**5 = 0.16
    assert not Speculation(SpeculationMode.OFF, 1.0).should("a")
    assert Speculation(SpeculationMode.ON, 0.0).should("a")


def exact_only_key(text: str) -> str:
    """The cache's exact key for `text` under EXACT_ONLY, as the gateway's predict scopes it."""
    scope = common_pb2.Scope(
        tenant="default", model=EXACT_ONLY, model_version="1", parameters={"top_k": "1"}
    )
    return exact_key(scope_tuple(scope), text)


def test_an_exact_only_miss_the_key_mirror_knows_sends_no_lookup() -> None:
    held, new, other = "reset my password", "where is my parcel", "cancel my order"

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.key_mirror.synced)
        m.cache.entries[held] = (common_pb2.Prediction(label="billing", score=0.9), EXACT)
        before = await m.counters()

        hit = await m.predict(held, model=EXACT_ONLY)  # listed: looked up
        miss = await m.predict(new, model=EXACT_ONLY)  # not listed: no lookup
        await m.settle()
        again = await m.predict(new, model=EXACT_ONLY)  # its store returned: looked up now
        semantic = await m.predict(other)  # a semantic model's miss is always looked up
        await m.settle()

        assert hit.cache.outcome == EXACT
        assert hit.prediction.label == "billing"
        assert miss.cache.outcome == MISS
        assert miss.cache.detail.startswith("not held by the cache")
        assert "cache_lookup" in hops(hit)
        assert "cache_lookup" not in hops(miss)
        assert (again.cache.outcome, semantic.cache.outcome) == (EXACT, MISS)
        assert [(r.text, r.scope.model) for r in m.cache.lookups] == [
            (held, EXACT_ONLY),
            (new, EXACT_ONLY),
            (other, MODEL),
        ]
        assert len(m.cache.stores) == 2  # the exact-only miss and the semantic one
        counts = changed(before, await m.counters())
        # Both stores' keys are held from their replies on, as the cache lists every key.
        assert (counts["cache_known_miss"], counts["key_mirror_keys"]) == (1, 2)

    run(scenario, listing=[exact_only_key(held)], key_mirror_keys=100)


def test_without_a_listing_every_exact_only_miss_is_looked_up() -> None:
    """A cache that cannot vouch for its keys (a Milvus fallback, peers) never ends a listing:
    the mirror stays unsynced and nothing is skipped."""

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.exact_tier.live)
        reply = await m.predict("where is my parcel", model=EXACT_ONLY)
        assert reply.cache.outcome == MISS
        assert "cache_lookup" in hops(reply)
        assert not m.gateway.key_mirror.synced
        assert len(m.cache.lookups) == 1

    run(scenario, key_mirror_keys=100)


STORED_TEXTS = [
    "where is my parcel",
    "reset my password",
    "cancel my order",
    "refuse this one",
    "update my card",
    "talk to a human",
]


def test_stores_that_linger_together_go_in_one_store_batch() -> None:
    """Stores wait HOPLINE_GATEWAY_STORE_LINGER_MS for others, then go in one StoreBatch,
    each still accepted or refused on its own."""

    async def scenario(m: Mesh) -> None:
        before = await m.counters()
        replies = await asyncio.gather(*(m.predict(t, model=EXACT_ONLY) for t in STORED_TEXTS))
        assert {r.cache.outcome for r in replies} == {MISS}  # answered before any store
        assert m.cache.store_batches == []  # still lingering
        await m.settle()
        assert m.cache.store_batches == [len(STORED_TEXTS)]
        assert sorted(s.text for s in m.cache.stores) == sorted(STORED_TEXTS[:3] + STORED_TEXTS[4:])
        counts = changed(before, await m.counters())
        assert (counts["stores"], counts["store_errors"]) == (5, 1)  # the refused one alone

    run(scenario, store_linger_ms=30.0)


def test_without_a_linger_stores_waiting_for_a_free_call_go_together() -> None:
    """No linger: one StoreBatch call in flight (the stages' default) goes alone at once; the
    stores that come while it waits go together in the next."""

    async def scenario(m: Mesh) -> None:
        m.cache.store_gate = asyncio.Event()
        before = await m.counters()
        replies = await asyncio.gather(*(m.predict(t, model=EXACT_ONLY) for t in STORED_TEXTS))
        assert {r.cache.outcome for r in replies} == {MISS}
        await until(lambda: sum(m.cache.store_batches) == 1)  # the one in flight, alone
        m.cache.store_gate.set()
        await m.settle()
        assert m.cache.store_batches == [1, len(STORED_TEXTS) - 1]
        assert sorted(s.text for s in m.cache.stores) == sorted(STORED_TEXTS[:3] + STORED_TEXTS[4:])
        counts = changed(before, await m.counters())
        assert (counts["stores"], counts["store_errors"]) == (5, 1)

    run(scenario, store_linger_ms=0.0)


def test_a_repeat_while_its_store_lingers_is_answered_by_the_gateway() -> None:
    """The gateway keeps its own answer from the moment it schedules the store, so a repeat
    that comes before the store is sent is an exact hit with no hop, not a second inference."""

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.exact_tier.live)
        miss = await m.predict("where is my parcel", model=EXACT_ONLY)
        repeat = await m.predict("where is my parcel", model=EXACT_ONLY)
        assert m.cache.store_batches == []  # the store had not gone yet
        assert (miss.cache.outcome, repeat.cache.outcome) == (MISS, EXACT)
        assert repeat.cache.detail == "answered by the gateway's local exact tier"
        assert len(m.inference.requests) == 1
        await m.settle()
        assert [s.text for s in m.cache.stores] == ["where is my parcel"]

    run(scenario, local_exact_entries=100, store_linger_ms=200.0)


def test_a_cache_without_store_batch_gets_one_store_call_each() -> None:
    """A cache from before StoreBatch (a rolling upgrade) answers it UNIMPLEMENTED: the store
    goes by Store instead, and so do the next ones for a while."""

    async def scenario(m: Mesh) -> None:
        m.cache.store_batch_error = rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        before = await m.counters()
        await m.predict("where is my parcel", model=EXACT_ONLY)
        await m.settle()
        await m.predict("reset my password", model=EXACT_ONLY)
        await m.settle()
        assert m.cache.store_batches == [1]  # tried once
        assert [s.text for s in m.cache.stores] == ["where is my parcel", "reset my password"]
        counts = changed(before, await m.counters())
        assert (counts["stores"], counts.get("store_errors", 0)) == (2, 0)

    run(scenario)
