"""Latency of `hopline predict`-style requests through a running mesh vs the same tokenizer,
model and postprocessing called in one process, measured one after the other in one run.

Usage: .venv/bin/python bench/mesh_vs_inprocess.py [--gateway ADDR] [--requests N]
(the full harness with baselines, open loop and batching is `hopline bench`, a later issue).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import grpc
import numpy as np

from hopline.client import gateway_address
from hopline.common.v1 import common_pb2
from hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.model.repository import ModelRepository
from hopline.model.session import make_session
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.postprocess.logic import predictions

TEMPLATES = [
    "where is my order number {n}",
    "I was charged twice on invoice {n}, please help",
    "can't log in to account {n}, forgot my password",
    "I want to return item {n}, it arrived broken",
]


def texts(count: int, salt: str) -> list[str]:
    # Unique texts, so the exact cache cannot answer (and BYPASS is set anyway).
    return [TEMPLATES[i % len(TEMPLATES)].format(n=f"{salt}{i}") for i in range(count)]


def summarise(name: str, ms: list[float]) -> str:
    a = np.array(ms)
    return (
        f"{name:<10} n={len(a)}  p50={np.percentile(a, 50):6.2f} ms  "
        f"p90={np.percentile(a, 90):6.2f}  p99={np.percentile(a, 99):6.2f}  "
        f"mean={a.mean():6.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gateway", default=None)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--model-repo", default=os.environ.get("HOPLINE_MODEL_REPO", "models"))
    args = parser.parse_args()

    cfg = ModelRepository(Path(args.model_repo)).resolve("support-intents")
    # One intra-op thread: the fastest in-process setting measured here (3.4 ms vs 6.7 ms
    # for two threads), so the baseline is the best the in-process pipeline can do.
    session = make_session(cfg.file("model"), threads=1)
    tokenizer = load_tokenizer(cfg.file("tokenizer"), cfg.max_sequence_length)
    inprocess: list[float] = []
    for text in texts(args.requests + 20, "p"):
        start = time.perf_counter()
        batch = encode(tokenizer, [text])
        (logits,) = session.run(
            ["logits"], {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        )
        predictions(logits, None, cfg.labels, cfg.oos_threshold, 1)
        inprocess.append((time.perf_counter() - start) * 1e3)
    del session

    mesh: list[float] = []
    hops: dict[str, list[float]] = {}
    with grpc.insecure_channel(gateway_address(args.gateway)) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for text in texts(args.requests + 20, "m"):
            start = time.perf_counter()
            reply = stub.Predict(
                gateway_pb2.PredictRequest(text=text, cache_mode=common_pb2.CACHE_MODE_BYPASS),
                timeout=10,
            )
            mesh.append((time.perf_counter() - start) * 1e3)
            for t in reply.timings:
                hops.setdefault(t.hop, []).append(t.ms)
    # The first 20 of each are warm-up.
    print(summarise("inprocess", inprocess[20:]))
    print(summarise("mesh", mesh[20:]))
    for hop, ms in hops.items():
        print("  " + summarise(hop, ms[20:]))
    ratio = np.percentile(mesh[20:], 50) / np.percentile(inprocess[20:], 50)
    print(f"mesh/inprocess p50 ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
