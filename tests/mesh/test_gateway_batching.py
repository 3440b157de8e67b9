"""Gateway batching against the real services: misses sent at the same moment travel to each
stage together, answer exactly as they do one by one, and a row a stage refuses fails only its
own request."""

from __future__ import annotations

import asyncio
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

BYPASS = common_pb2.CACHE_MODE_BYPASS
TEXTS = [
    f"{opening} {subject} {ending}"
    for opening in ("please help,", "hi,", "urgent:")
    for subject in (
        "I forgot my password",
        "where is my parcel",
        "I want a refund for my order",
        "cancel my subscription today",
        "let me talk to a person",
        "my card was charged twice",
    )
    for ending in ("thanks", "right now please")
]
TOO_LONG = "word " * 100  # the tokenizer here takes 300 bytes; the gateway takes more


@pytest.fixture(scope="module")
def batching_mesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("batching")
    shutil.copytree(default_repo / DEFAULT_MODEL, work / "models" / DEFAULT_MODEL)
    # One RPC in flight per stage: every request that arrives meanwhile joins the next batch.
    mesh = Mesh(
        work / "models",
        work,
        service_env={"tokenizer": {"HOPLINE_MAX_TEXT_BYTES": "300"}},
        HOPLINE_GATEWAY_BATCH_IN_FLIGHT="1",
    )
    try:
        yield mesh.start()
    finally:
        mesh.stop()


Outcome = gateway_pb2.PredictResponse | grpc.aio.AioRpcError


async def _predict_all(mesh: Mesh, texts: list[str]) -> list[Outcome]:
    async with grpc.aio.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one(text: str) -> Outcome:
            request = gateway_pb2.PredictRequest(text=text, top_k=3, cache_mode=BYPASS)
            try:
                reply: gateway_pb2.PredictResponse = await stub.Predict(request, timeout=60)
            except grpc.aio.AioRpcError as err:
                return err
            return reply

        return list(await asyncio.gather(*(one(t) for t in texts)))


def _batched_rows(mesh: Mesh, stage: str) -> float:
    """Rows the gateway sent in batches of more than one to `stage`, from its /metrics."""
    url = f"http://127.0.0.1:{mesh.metrics_ports['gateway']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    pattern = rf'^hopline_batch_size_sum\{{component="gateway\.{stage}",[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_concurrent_misses_are_batched_and_answer_as_single_requests(
    batching_mesh: Mesh,
) -> None:
    # One at a time: nothing is ever in flight beside a request, so none is batched.
    singles = [asyncio.run(_predict_all(batching_mesh, [t]))[0] for t in TEXTS]
    assert _batched_rows(batching_mesh, "inference") == 0
    together = asyncio.run(_predict_all(batching_mesh, TEXTS))
    for stage in ("tokenize", "inference", "postprocess"):
        assert _batched_rows(batching_mesh, stage) > 0, f"no batch reached {stage}"
    for text, single, batched in zip(TEXTS, singles, together, strict=True):
        assert isinstance(single, gateway_pb2.PredictResponse), text
        assert isinstance(batched, gateway_pb2.PredictResponse), text
        # Padding to the batch's longest row is masked out: equal up to float rounding.
        assert [s.label for s in batched.prediction.top_k] == [
            s.label for s in single.prediction.top_k
        ], text
        for a, b in zip(batched.prediction.top_k, single.prediction.top_k, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-4), text
        assert batched.prediction.out_of_scope == single.prediction.out_of_scope


def test_a_row_the_tokenizer_refuses_fails_only_its_request(batching_mesh: Mesh) -> None:
    texts = [*TEXTS[:12], TOO_LONG, *TEXTS[12:24]]
    replies = asyncio.run(_predict_all(batching_mesh, texts))
    refused = replies[12]
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokenize" in (refused.details() or "")
    ok = [r for i, r in enumerate(replies) if i != 12]
    assert all(isinstance(r, gateway_pb2.PredictResponse) for r in ok)
