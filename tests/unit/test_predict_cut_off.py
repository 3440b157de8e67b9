"""A request cut off while the gateway waits for its cache lookup (its caller cancelled, or
its deadline ran out) takes the work it started beside the lookup with it: the early
tokenize and a speculative inference (gateway/service.py:GatewayService.predict_text). Left,
they ran on for nobody, and their failures were logged "Task exception was never retrieved"
(a fuzzing probe: 486 in a run). The gateway's own service with its cache and model paths'
calls replaced, so that the test decides when each answers; the whole mesh is not needed to
show whose task is cancelled."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest
from gateway_fakes import Models, Pool

from hopline.gateway.call import PredictCall
from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import GatewayService
from hopline.gateway.upstream import GatewayUpstreams
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2


@pytest.mark.parametrize("speculating", [False, True])
def test_the_work_beside_a_lookup_goes_with_the_request(
    monkeypatch: pytest.MonkeyPatch, speculating: bool
) -> None:
    async def scenario() -> None:
        pools = [Pool(object()), Pool(object()), Pool(Models()), Pool(object())]
        gateway = GatewayService(GatewayConfig(), GatewayUpstreams(*cast(Any, pools)))
        beside: list[asyncio.Future[Any]] = []
        started = asyncio.Event()

        async def never(*_: Any) -> Any:
            await asyncio.sleep(3600)

        def tokenize_early(call: PredictCall) -> None:
            call.tokenizing = asyncio.ensure_future(never())
            beside.append(call.tokenizing)
            started.set()

        def speculate(call: PredictCall) -> asyncio.Future[Any] | None:
            if not speculating:
                return None
            beside.append(asyncio.ensure_future(never()))
            return beside[-1]

        monkeypatch.setattr(gateway.cache_path, "local_answer", lambda call: None)
        monkeypatch.setattr(gateway.cache_path, "known_miss", lambda call: False)
        monkeypatch.setattr(gateway.cache_path, "look_up", never)
        monkeypatch.setattr(gateway.model_path, "tokenize_early", tokenize_early)
        monkeypatch.setattr(gateway.model_path, "speculate", speculate)
        info = inference_pb2.ModelInfo(
            name="intents", version="1", cache=inference_pb2.CachePolicy(mode="exact", ttl_s=60)
        )
        request = asyncio.ensure_future(
            gateway.predict_text(
                "where is my parcel", info, "t", 1, common_pb2.CACHE_MODE_USE, 5.0,
                time.perf_counter(),
            )
        )  # fmt: skip
        await started.wait()
        await asyncio.sleep(0.01)  # in its lookup
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.sleep(0)
        assert gateway.admission.in_flight == 0
        # Checked here: asyncio.run cancels whatever is left when the scenario ends.
        assert len(beside) == 1 + speculating
        assert all(task.cancelled() for task in beside)

    asyncio.run(scenario())


@pytest.mark.parametrize("speculating", [False, True])
def test_a_request_that_joined_a_cut_off_requests_run_is_still_answered(
    monkeypatch: pytest.MonkeyPatch, speculating: bool
) -> None:
    """A leads the inference for a text and B, the same text, joins it (the coalescer); A's
    run waits on A's early tokenize. When A was cut off, its tokenize was cancelled with it
    and B, whose caller still waited, was cancelled too (a reviewer's reproduction). The
    shared run asks for the tokens again. The hops are replaced with slow stand-ins."""

    async def scenario() -> None:
        pools = [Pool(object()), Pool(object()), Pool(Models()), Pool(object())]
        gateway = GatewayService(GatewayConfig(), GatewayUpstreams(*cast(Any, pools)))
        model, cache = gateway.model_path, gateway.cache_path
        tokenized: list[str] = []

        async def tokenize(request: Any, timeout_s: float, timings: dict[str, float]) -> Any:
            await asyncio.sleep(0.3)  # a busy tokenizer
            tokenized.append(request.texts[0])
            return tokenizer_pb2.TokenizeResponse()

        async def infer(request: Any, timeout_s: float, timings: dict[str, float]) -> Any:
            return inference_pb2.InferResponse()

        async def postprocess(request: Any, timeout_s: float, timings: dict[str, float]) -> Any:
            return postprocess_pb2.PostprocessResponse(
                predictions=[common_pb2.Prediction(label="a", score=1.0)]
            )

        async def look_up(call: PredictCall) -> None:
            await asyncio.sleep(0.2 if speculating else 0.01)  # a miss

        monkeypatch.setattr(model, "tokenize", tokenize)
        monkeypatch.setattr(model, "infer", infer)
        monkeypatch.setattr(model, "postprocess", postprocess)
        monkeypatch.setattr(cache, "local_answer", lambda call: None)
        monkeypatch.setattr(cache, "known_miss", lambda call: False)
        monkeypatch.setattr(cache, "look_up", look_up)
        if speculating:
            monkeypatch.setattr(model.speculation, "should", lambda name: True)
        else:
            monkeypatch.setattr(model, "speculate", lambda call: None)
        info = inference_pb2.ModelInfo(
            name="intents",
            version="1",
            labels=["a"],
            cache=inference_pb2.CachePolicy(mode="exact", ttl_s=60),
        )

        def predict() -> asyncio.Future[Any]:
            return asyncio.ensure_future(
                gateway.predict_text(
                    "where is my parcel", info, "t", 1, common_pb2.CACHE_MODE_USE, 5.0,
                    time.perf_counter(),
                )
            )  # fmt: skip

        a = predict()
        await asyncio.sleep(0.05)  # A leads the run (or its speculative run)
        b = predict()
        await asyncio.sleep(0.05)
        assert model.coalescer.coalesced == 1  # B joined it
        a.cancel()
        answered = await b
        assert answered.prediction.label == "a"
        assert answered.cache.coalesced
        assert tokenized  # asked again for the run B rides

    asyncio.run(scenario())
