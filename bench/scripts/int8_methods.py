"""Which INT8: ONNX Runtime's dynamic quantization or static QDQ calibrated on training texts?

The FP32 MiniLM encoder graph (model/encoder.py, no head) is converted six ways; each is
compared with FP32 on the reference sentences (embedding cosine, mean and worst) and timed at
batch 1 and 32 on support-intents texts, all models taking turns call by call:

- dynamic, weights per tensor / per channel, and per channel after the outlier rewrites
  (what model/quantize.py ships: hopline.model.outliers, calibrated on the training texts);
- static QDQ, u8 activations and s8 weights per channel, scales from MinMax or Percentile
  calibration over half the training texts (padded to 64 tokens: the calibrator stacks
  batches, so every one has one shape);
- static QDQ, s8 activations (symmetric), MinMax.

Activation x activation MatMuls (attention) stay FP32 in every variant.

Usage: .venv/bin/python bench/scripts/int8_methods.py [--iterations 100]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from hopline.model.build import (
    DEFAULT_CHECK_SENTENCES,
    DEFAULT_TRAIN_FILE,
    default_weights_dir,
    load_examples,
    load_sentences,
)
from hopline.model.encoder import build_encoder_graph
from hopline.model.outliers import calibration_feeds
from hopline.model.quantize import cosines, quantize_int8
from hopline.model.session import embed_texts, make_session
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, encode, load_tokenizer

CALIBRATION_LENGTH = 64


class Texts(CalibrationDataReader):  # type: ignore[misc]
    def __init__(self, tokenizer: Any, texts: list[str], batch: int = 8) -> None:
        self.feeds = []
        for start in range(0, len(texts) - batch + 1, batch):
            enc = encode(tokenizer, texts[start : start + batch])
            pad = CALIBRATION_LENGTH - min(enc.input_ids.shape[1], CALIBRATION_LENGTH)
            self.feeds.append(
                {
                    name: np.pad(a[:, :CALIBRATION_LENGTH], ((0, 0), (0, pad)))
                    for name, a in (
                        ("input_ids", enc.input_ids),
                        ("attention_mask", enc.attention_mask),
                    )
                }
            )
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        self.i += 1
        return self.feeds[self.i - 1] if self.i <= len(self.feeds) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the quantizers' per-tensor chatter
    weights = default_weights_dir()
    tokenizer = load_tokenizer(weights / "tokenizer.json", DEFAULT_MAX_LENGTH)
    train = [t for t, _ in load_examples(DEFAULT_TRAIN_FILE)]
    sentences = (
        load_sentences(DEFAULT_CHECK_SENTENCES) if DEFAULT_CHECK_SENTENCES.is_file() else train[:64]
    )
    graph = build_encoder_graph(weights)
    weight_names = {i.name for i in graph.graph.initializer}
    attention = [
        n.name for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] not in weight_names
    ]
    tmp = Path(tempfile.mkdtemp(prefix="hopline-int8-"))
    onnx.save(graph, str(tmp / "fp32.onnx"))
    common: dict[str, Any] = {"op_types_to_quantize": ["MatMul"], "nodes_to_exclude": attention}
    for per_channel, name in ((False, "dynamic_per_tensor"), (True, "dynamic_per_channel")):
        quantize_dynamic(
            graph,
            tmp / f"{name}.onnx",
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            **common,
        )
    quantize_int8(graph, tmp / "shipped.onnx", calibration_feeds(tokenizer, train))
    for name, activation, method, extra in (
        ("static_qdq_u8s8_minmax", QuantType.QUInt8, CalibrationMethod.MinMax, {}),
        (
            "static_qdq_u8s8_percentile",
            QuantType.QUInt8,
            CalibrationMethod.Percentile,
            {"CalibPercentile": 99.999},
        ),
        (
            "static_qdq_s8s8_minmax",
            QuantType.QInt8,
            CalibrationMethod.MinMax,
            {"ActivationSymmetric": True},
        ),
    ):
        quantize_static(
            tmp / "fp32.onnx", tmp / f"{name}.onnx", Texts(tokenizer, train[::2]),
            quant_format=QuantFormat.QDQ, activation_type=activation, weight_type=QuantType.QInt8,
            per_channel=True, calibrate_method=method, extra_options=extra, **common,
        )  # fmt: skip
    names = ["fp32", "dynamic_per_tensor", "dynamic_per_channel", "shipped",
             "static_qdq_u8s8_minmax", "static_qdq_u8s8_percentile",
             "static_qdq_s8s8_minmax"]  # fmt: skip
    sessions = {n: make_session(tmp / f"{n}.onnx") for n in names}
    reference = embed_texts(sessions["fp32"], tokenizer, sentences)
    result: dict[str, Any] = {}
    for n, session in sessions.items():
        cos = cosines(embed_texts(session, tokenizer, sentences), reference)
        result[n] = {
            "cosine_mean": round(float(cos.mean()), 4),
            "cosine_min": round(float(cos.min()), 4),
        }
    rng = np.random.default_rng(0)
    for batch in (1, 32):
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.iterations):
            enc = encode(tokenizer, [train[j] for j in rng.choice(len(train), batch)])
            feed = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}
            for n in names if i % 2 == 0 else reversed(names):
                started = time.perf_counter()
                sessions[n].run(["sentence_embedding"], feed)
                times[n].append(time.perf_counter() - started)
        base = float(np.median(times["fp32"]))
        for n in names:
            result[n][f"speedup_b{batch}"] = round(base / float(np.median(times[n])), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
