"""Dynamic batching in a real inference service: overload is refused RESOURCE_EXHAUSTED,
not queued without bound. The batcher itself is unit-tested in tests/unit/test_batching.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from conftest import BATCH_TEXTS, DEFAULT_MODEL
from harness import Mesh
from hopline.model.repository import load_config
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.runtime.tensors import to_tensor


def test_full_queue_returns_resource_exhausted(default_repo: Path, tmp_path: Path) -> None:
    """A real inference service with a 4-row queue, hit by 24 concurrent 4-row requests; then
    one request of more rows than its runs and queue ever hold at once, which no retry
    serves: INVALID_ARGUMENT naming the most a request may carry (it was RESOURCE_EXHAUSTED,
    "retry with backoff")."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    config_path = repo / DEFAULT_MODEL / "1" / "config.json"
    config = json.loads(config_path.read_text())
    config["dynamic_batching"] = {"max_queue_size": 4, "max_batch_size": 4}
    config_path.write_text(json.dumps(config))
    mesh = Mesh(repo, tmp_path)
    mesh.start(("inference",))
    try:
        cfg = load_config(config_path.parent)
        tokenizer = load_tokenizer(cfg.file("tokenizer"), cfg.max_sequence_length)
        batch = encode(tokenizer, BATCH_TEXTS[:4])
        request = inference_pb2.InferRequest(
            model=DEFAULT_MODEL,
            inputs=[
                to_tensor("input_ids", batch.input_ids),
                to_tensor("attention_mask", batch.attention_mask),
            ],
        )

        async def burst() -> list[Any]:
            async with grpc.aio.insecure_channel(mesh.addrs["inference"]) as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                calls = [stub.Infer(request, timeout=30) for _ in range(24)]
                return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(burst())
        ids, mask = (np.tile(a, (16, 1)) for a in (batch.input_ids, batch.attention_mask))
        huge = inference_pb2.InferRequest(
            model=DEFAULT_MODEL,
            inputs=[to_tensor("input_ids", ids), to_tensor("attention_mask", mask)],
        )
        with grpc.insecure_channel(mesh.addrs["inference"]) as channel:
            try:
                inference_pb2_grpc.InferenceServiceStub(channel).Infer(huge, timeout=30)
                raise AssertionError("64 rows beside runs of 4 and a 4-row queue: answered")
            except grpc.RpcError as refusal:
                too_many = refusal
    finally:
        mesh.stop()
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    answered = [r for r in results if isinstance(r, inference_pb2.InferResponse)]
    assert refused, "no request was refused by a 4-row queue under a 96-row burst"
    assert answered, "every request was refused"
    assert len(refused) + len(answered) == len(results)
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "inference queue for support-intents" in (err.details() or "")
        assert "retry with backoff" in (err.details() or "")
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT, too_many
    assert "64 rows in one request" in (too_many.details() or "")
    assert "rows a request" in (too_many.details() or "")
    for reply in answered:
        logits = next(t for t in reply.outputs if t.name == "logits")
        assert logits.dtype == common_pb2.DATA_TYPE_FP32
        assert list(logits.shape) == [4, 26]
