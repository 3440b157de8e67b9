"""Model compute alone, model against model: `hopline bench --models A,B` at batch 1 and 32.

Only the ONNX Runtime run is timed (tokenized inputs are built first), with the inference
service's own backend and thread setting. The models take turns call by call (A, B, A, B...)
on the same inputs, so a busy neighbour on a shared machine slows both alike instead of
whichever happened to be measured at the time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from hopline.model.repository import ModelConfig
from hopline.model.spin import Spin
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.services.inference.backend import OnnxRuntimeBackend


def batch_feeds(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    batch: int,
    count: int,
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    """`count` model inputs of `batch` texts drawn from `texts`, each padded to its longest."""
    feeds = []
    for _ in range(count):
        enc = encode(tokenizer, [texts[i] for i in rng.choice(len(texts), batch)])
        feeds.append({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
    return feeds


def compare_compute(
    configs: Sequence[ModelConfig],
    texts: Sequence[str],
    *,
    batches: Sequence[int] = (1, 32),
    iterations: int = 200,
    threads: int,
    spin: Spin,
) -> dict[str, Any]:
    """Per model and batch size: p50/p99/mean ms over `iterations` alternated runs; and each
    model's p50 speed-up over the first model's."""
    backends = [OnnxRuntimeBackend(cfg, threads, spin=spin) for cfg in configs]
    tokenizer = load_tokenizer(configs[0].file("tokenizer"), configs[0].max_sequence_length)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        "iterations": iterations,
        "threads": threads,
        "spin": spin.value,
        "models": {},
    }
    for batch in batches:
        feeds = batch_feeds(tokenizer, texts, batch, iterations, rng)
        for backend in backends:  # warm: the first runs of a shape allocate
            for feed in feeds[:3]:
                backend.run(feed, ["logits"])
        times: list[list[float]] = [[] for _ in backends]
        for i, feed in enumerate(feeds):
            # Who goes first alternates too: the second run can find caches warmer.
            order = range(len(backends)) if i % 2 == 0 else reversed(range(len(backends)))
            for k in order:
                started = time.perf_counter_ns()
                backends[k].run(feed, ["logits"])
                times[k].append((time.perf_counter_ns() - started) / 1e6)
        base = float(np.median(times[0]))
        for cfg, ms in zip(configs, times, strict=True):
            p50 = float(np.median(ms))
            out["models"].setdefault(f"{cfg.key} ({cfg.precision})", {})[f"batch_{batch}"] = {
                "p50_ms": p50,
                "p99_ms": float(np.percentile(ms, 99)),
                "mean_ms": float(np.mean(ms)),
                "speedup_over_first": base / p50,
            }
    return out


def compute_table(result: dict[str, Any]) -> str:
    lines = [f"model compute alone, alternated, {result['iterations']} runs per batch size:"]
    for name, by_batch in result["models"].items():
        cells = "  ".join(
            f"{batch}: p50 {v['p50_ms']:.2f} p99 {v['p99_ms']:.2f} ms "
            f"(x{v['speedup_over_first']:.2f})"
            for batch, v in by_batch.items()
        )
        lines.append(f"  {name:<28} {cells}")
    return "\n".join(lines)
