"""A semantic miss runs one encoder: the model's head on the cache lookup's query embedding.

The default FP32 model's encoder is the cache's (same weights, graph and tokenizer), so its
version names the cache's encoder as `head_embedder` and ships the head alone. Real
processes, a real milvus-lite file and the default model; `nohead` is a copy of it whose
config names no head, as a converted (INT8) version's does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh, add_model
from hopline.gateway.client import predict
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.tensors import from_tensor, to_tensor

MISS = common_pb2.CACHE_OUTCOME_MISS
TEXTS = (
    "my package never showed up and the tracking has not moved",
    "how do I change the email address on my account",
    "the app crashes every time I open the settings page",
    "can I get a refund for a duplicate charge",
)


@pytest.fixture(scope="module")
def smesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("shared-embedding")
    repo = work / "models"
    source = default_repo / DEFAULT_MODEL / "1"
    if not json.loads((source / "config.json").read_text()).get("head_embedder"):
        pytest.fail(f"{source} has no head: rebuild the default model (`rm -r models; make model`)")
    add_model(repo, source, "sem", "1", mode="semantic", threshold=0.95)
    add_model(repo, source, "nohead", "1", mode="semantic", threshold=0.95)
    cfg_file = repo / "nohead" / "1" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["head_embedder"] = ""
    del cfg["files"]["head"]
    cfg_file.write_text(json.dumps(cfg))
    m = Mesh(
        repo,
        work,
        HOPLINE_DEFAULT_MODEL="sem",
        HOPLINE_CACHE_BUDGET_MS="2000",  # a slow CI machine must not turn misses into fail-opens
    )
    try:
        yield m.start()
    finally:
        m.stop()


def test_a_semantic_miss_runs_the_head_on_the_lookups_embedding(smesh: Mesh) -> None:
    for i, text in enumerate(TEXTS):
        shared = predict(text, gateway=smesh.gateway, tenant=f"t-share-{i}", timeout_s=30)
        assert shared.cache.outcome == MISS, shared.cache
        timings = {t.hop for t in shared.timings}
        # No token ids were asked for: the lookup's vector went to the head.
        assert "tokenize" not in timings, timings
        assert "inference" in timings, timings
        # BYPASS never looks the text up, so it runs the whole model on token ids.
        full = predict(text, gateway=smesh.gateway, cache_mode="bypass", timeout_s=30)
        assert "tokenize" in {t.hop for t in full.timings}
        assert shared.prediction.label == full.prediction.label
        assert shared.prediction.score == pytest.approx(full.prediction.score, abs=1e-5)


def test_a_model_without_a_head_tokenizes_its_misses(smesh: Mesh) -> None:
    answer = predict(TEXTS[0], gateway=smesh.gateway, model="nohead", tenant="t-nohead")
    assert answer.cache.outcome == MISS, answer.cache
    assert "tokenize" in {t.hop for t in answer.timings}


def _embedding(smesh: Mesh, text: str) -> cache_pb2.LookupResponse:
    scope = common_pb2.Scope(tenant="t-direct", model="sem", model_version="1")
    with grpc.insecure_channel(smesh.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        found: cache_pb2.LookupResponse = stub.Lookup(
            cache_pb2.LookupRequest(scope=scope, text=text, mode="semantic", threshold=0.99),
            timeout=30,
        )
    return found


def test_inference_takes_an_embedding_in_place_of_tokens(smesh: Mesh) -> None:
    found = _embedding(smesh, TEXTS[1])
    with grpc.insecure_channel(smesh.addrs["inference"]) as channel:
        models = inference_pb2_grpc.InferenceServiceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), timeout=30
        )
        heads = {m.name: m.head_embedder for m in models.models}
    assert heads["sem"] == found.embedder
    assert found.embedder.startswith("all-MiniLM-L6-v2@")
    assert heads["nohead"] == ""
    with grpc.insecure_channel(smesh.addrs["tokenizer"]) as channel:
        tokens = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Tokenize(
            tokenizer_pb2.TokenizeRequest(model="sem", model_version="1", texts=[TEXTS[1]]),
            timeout=30,
        )
    with grpc.insecure_channel(smesh.addrs["inference"]) as channel:
        infer = inference_pb2_grpc.InferenceServiceStub(channel).Infer
        from_tokens = infer(
            inference_pb2.InferRequest(
                model="sem", model_version="1", inputs=[tokens.input_ids, tokens.attention_mask]
            ),
            timeout=30,
        )
        from_vector = infer(
            inference_pb2.InferRequest(model="sem", inputs=[found.query_embedding]), timeout=30
        )
    full = {t.name: np.asarray(from_tensor(t), np.float32) for t in from_tokens.outputs}
    head = {t.name: np.asarray(from_tensor(t), np.float32) for t in from_vector.outputs}
    assert set(head) == {"logits", "sentence_embedding"}
    np.testing.assert_allclose(head["sentence_embedding"], full["sentence_embedding"], atol=1e-5)
    np.testing.assert_allclose(head["logits"], full["logits"], atol=1e-4)


@pytest.mark.parametrize(
    ("model", "tensor", "needle"),
    [
        ("nohead", np.zeros((1, 384), np.float32), "head_embedder"),
        ("sem", np.zeros((1, 383), np.float32), "[1..64, 384]"),
        ("sem", np.zeros((65, 384), np.float32), "[1..64, 384]"),
        ("sem", np.zeros((1, 384), np.int64), "FP32"),
        ("sem", np.zeros(384, np.float32), "FP32 [rows, 384]"),
    ],
)
def test_a_bad_embedding_is_invalid_argument(
    smesh: Mesh, model: str, tensor: np.ndarray, needle: str
) -> None:
    with grpc.insecure_channel(smesh.addrs["inference"]) as channel:
        infer = inference_pb2_grpc.InferenceServiceStub(channel).Infer
        with pytest.raises(grpc.RpcError) as err:
            infer(
                inference_pb2.InferRequest(
                    model=model, inputs=[to_tensor("sentence_embedding", tensor)]
                ),
                timeout=30,
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert needle in (err.value.details() or ""), err.value.details()
