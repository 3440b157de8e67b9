"""Tokenizer, model and postprocessing of one model version, called in one process.

The same code the services run, without the hops: the reference for what the mesh must
answer (`hopline cache calibrate` and `eval` label pairs with it). `hopline bench`'s
in-process baselines are bench/targets.py's own (threaded, and through the batcher).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hopline.model.repository import ModelConfig, ModelRepository
from hopline.model.session import make_session
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.services.postprocess.logic import predictions


class Pipeline:
    def __init__(self, config: ModelConfig, *, threads: int = 0) -> None:
        self.config = config
        self.session = make_session(
            config.file("model"), threads=threads, providers=config.providers
        )
        self.tokenizer = load_tokenizer(config.file("tokenizer"), config.max_sequence_length)

    @classmethod
    def load(cls, repo: Path, name: str, version: str = "", *, threads: int = 0) -> Pipeline:
        return cls(ModelRepository(repo).resolve(name, version), threads=threads)

    def predict(self, texts: Sequence[str], top_k: int = 1) -> list[common_pb2.Prediction]:
        """One run for all of `texts`, padded to the longest (what a dynamic batch does)."""
        batch = encode(self.tokenizer, list(texts))
        (logits,) = self.session.run(
            ["logits"], {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        )
        return predictions(logits, None, self.config.labels, self.config.oos_threshold, top_k)

    def predict_many(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> list[common_pb2.Prediction]:
        """Bulk labelling in length-sorted batches (little padding), in the input's order."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out: list[common_pb2.Prediction | None] = [None] * len(texts)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            for i, prediction in zip(idx, self.predict([texts[i] for i in idx]), strict=True):
                out[i] = prediction
        return [p for p in out if p is not None]
