"""The gateway's own steps, its upstreams stand-ins (only the gateway is under test):

- a repeat its local exact tier holds is answered before admission (gateway/service.py:
  GatewayService.predict_text): never refused at the in-flight limit, no place taken, no flow
  set, nothing run;
- its circuit to the cache is a metric, read at each scrape."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from gateway_fakes import Models, Pool
from prometheus_client import REGISTRY

from hopline.gateway.cache_path import EXACT
from hopline.gateway.call import PredictCall
from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import GatewayService
from hopline.gateway.upstream import GatewayUpstreams
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.runtime.fairness import FLOW


def test_a_local_repeat_is_answered_at_the_in_flight_limit_without_a_place() -> None:
    async def scenario() -> None:
        pools = [Pool(object()), Pool(object()), Pool(Models()), Pool(object())]
        config = GatewayConfig(max_in_flight=1)
        gateway = GatewayService(config, GatewayUpstreams(*cast(Any, pools)))
        held = common_pb2.Prediction(label="order_status", score=0.9)
        flows: list[object] = []

        def local_answer(call: PredictCall) -> common_pb2.Prediction:
            call.local = True
            call.cache.outcome = EXACT
            return held

        def record_outcome(call: PredictCall) -> None:
            flows.append(FLOW.get())

        gateway.cache_path.local_answer = local_answer  # type: ignore[method-assign]
        gateway.cache_path.record_outcome = record_outcome  # type: ignore[method-assign]
        info = inference_pb2.ModelInfo(
            name="intents", version="1", cache=inference_pb2.CachePolicy(mode="exact", ttl_s=60)
        )
        other = PredictCall.new(
            "another text", info, "t", 1, common_pb2.CACHE_MODE_USE, 5.0, time.perf_counter()
        )
        admitted, done = asyncio.Event(), asyncio.Event()

        async def hold_the_one_place() -> None:  # another request, in its own task
            with gateway.admission.admit(other):
                admitted.set()
                await done.wait()

        holder = asyncio.create_task(hold_the_one_place())
        await admitted.wait()
        reply = await gateway.predict_text(
            "where is my parcel", info, "t", 1, common_pb2.CACHE_MODE_USE, 5.0,
            time.perf_counter(),
        )  # fmt: skip
        assert gateway.admission.in_flight == 1
        done.set()
        await holder
        assert reply.prediction == held
        assert reply.cache.outcome == EXACT
        assert [t.hop for t in reply.timings] == ["total"]
        assert flows == [None]  # counted, and as no tenant's flow: it queues nowhere

    asyncio.run(scenario())


def test_the_cache_circuit_is_a_metric() -> None:
    """hopline_cache_circuit_open says what GetStats says, read at each scrape (open turns
    half-open with time alone): an alert on the cache's circuit needed GetStats before."""
    pools = [Pool(object()), Pool(object()), Pool(Models()), Pool(object())]
    config = GatewayConfig(cache_breaker_failures=1, cache_breaker_cooldown_s=60.0)
    gateway = GatewayService(config, GatewayUpstreams(*cast(Any, pools)))
    assert REGISTRY.get_sample_value("hopline_cache_circuit_open") == 0.0
    gateway.breaker.failure()
    assert REGISTRY.get_sample_value("hopline_cache_circuit_open") == 1.0
    gateway.breaker.success()
    assert REGISTRY.get_sample_value("hopline_cache_circuit_open") == 0.0
