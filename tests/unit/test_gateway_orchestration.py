"""The gateway's prediction path, in-process: a real GatewayService over stand-in upstreams
(tests/gateway_stand_ins.py): the order of the hops, cache hits and the ways around the
cache, failing open, upstream errors, coalescing, the counters GetStats reads and the store
policy.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, cast

import grpc
import pytest
from servicer_context import Aborted, AbortingContext

from conftest import until
from gateway_stand_ins import (
    EXACT,
    FAIL_OPEN,
    MISS,
    MODEL,
    SEMANTIC,
    SKIPPED,
    STATS_KEYS,
    UNCACHED,
    Mesh,
    changed,
    hops,
    rpc_error,
    run,
)
from hopline.gateway.upstream import HopError
from hopline.observability import metrics
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime.errors import StatusError


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
        # The store is scheduled, not awaited: it is queued once the reply is on its way
        # (the loop's next turn), and lands after it.
        assert (await m.counters())["stores_in_flight"] == 0
        await asyncio.sleep(0)
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
        assert re.search(r"retrying the cache in \d+\.\ds$", third.cache.detail), third.cache
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
        # In half-open, with its probe on its way, no countdown is left ("in 0.0s" read as
        # now for a whole outage): the detail says what the retry waits for.
        m.gateway.breaker._open_until = 0.0  # the cool-down over
        assert m.gateway.breaker.allow()  # the probe, now on its way
        fourth = await m.predict("is my order very late indeed")
        assert fourth.cache.detail.endswith("retrying the cache once a probe lookup answers")
        m.gateway.breaker.success()

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
