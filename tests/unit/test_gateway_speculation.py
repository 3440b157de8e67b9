"""Speculation: the gateway starting the model beside the cache lookup, and when it stops
(a real GatewayService over stand-in upstreams, tests/gateway_stand_ins.py).
"""

from __future__ import annotations

import asyncio

from conftest import until
from gateway_stand_ins import (
    EXACT,
    MISS,
    SEMANTIC,
    Mesh,
    changed,
    run,
)
from hopline.gateway.speculation import Speculation, SpeculationMode
from hopline.protos.hopline.common.v1 import common_pb2


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
