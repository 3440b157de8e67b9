"""Tokenizer and encoder against sentence-transformers' own output (../shared/reference)."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from harness import Mesh
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.tensors import from_tensor, to_tensor


def _tokenize(mesh: Mesh, texts: list[str]) -> tokenizer_pb2.TokenizeResponse:
    with grpc.insecure_channel(mesh.addrs["tokenizer"]) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        return stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(model="support-intents", texts=texts), timeout=10
        )


def test_token_ids_match_reference_one_by_one_and_batched(
    mesh: Mesh, reference: list[dict[str, Any]]
) -> None:
    texts = [r["text"] for r in reference]
    batched = _tokenize(mesh, texts)
    ids = from_tensor(batched.input_ids)
    mask = from_tensor(batched.attention_mask)
    assert ids.shape[1] == max(len(r["input_ids"]) for r in reference)  # padded to longest
    for i, record in enumerate(reference):
        single = _tokenize(mesh, [record["text"]])
        assert from_tensor(single.input_ids)[0].tolist() == record["input_ids"], record["text"]
        n = batched.lengths[i]
        assert ids[i, :n].tolist() == record["input_ids"], record["text"]
        assert mask[i].sum() == n
        assert not ids[i, n:].any()
        assert batched.truncated[i] == (len(record["input_ids"]) == 256 and n == 256)
    assert sum(batched.truncated) >= 2  # the reference holds texts longer than 256 tokens


def test_encoder_matches_reference_embeddings(mesh: Mesh, reference: list[dict[str, Any]]) -> None:
    """The built model's sentence_embedding output (torch-free ONNX graph) against
    sentence-transformers: cosine >= 0.9999 for every reference sentence, alone and in a
    padded batch."""
    with grpc.insecure_channel(mesh.addrs["inference"]) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        def embed(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            reply = stub.Infer(
                inference_pb2.InferRequest(
                    model="support-intents",
                    inputs=[to_tensor("input_ids", ids), to_tensor("attention_mask", mask)],
                    outputs=["sentence_embedding"],
                ),
                timeout=30,
            )
            (out,) = reply.outputs
            assert out.name == "sentence_embedding"
            return from_tensor(out)

        expected = np.array([r["embedding"] for r in reference], dtype=np.float32)
        worst = 1.0
        for i, record in enumerate(reference):
            ids = np.array([record["input_ids"]], dtype=np.int64)
            got = embed(ids, np.ones_like(ids))[0]
            worst = min(worst, float(got @ expected[i] / np.linalg.norm(got)))
        assert worst >= 0.9999, worst

        width = max(len(r["input_ids"]) for r in reference)
        ids = np.zeros((len(reference), width), dtype=np.int64)
        for i, record in enumerate(reference):
            ids[i, : len(record["input_ids"])] = record["input_ids"]
        got = embed(ids, (ids != 0).astype(np.int64))
        cosines = (got * expected).sum(axis=1) / np.linalg.norm(got, axis=1)
        assert cosines.min() >= 0.9999, cosines.min()
