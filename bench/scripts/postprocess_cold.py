"""What a miss's postprocessing costs right after a model run, numpy against plain Python.

A request's logits reach postprocessing just after its model run streamed ~90 MB of weights
through the caches, so the step runs cold. This times `services/postprocess/logic.py`'s
`predictions` against the numpy softmax-and-argsort it replaced (kept here as the baseline,
`numpy_predictions`), on random logits of the default model's width, each call right after a
sweep of a buffer larger than the last-level cache (cold) and again at once (hot), the two
ways alternated round by round. Both give the same labels and order; scores agree to float32.

Usage: .venv/bin/python bench/scripts/postprocess_cold.py [--rows 1,32] [--calls 300]
    [--rounds 4] [--sweep-mb 120]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from hopline.model.head import softmax
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.services.postprocess.logic import OUT_OF_SCOPE, predictions

CLASSES = 26
THRESHOLD = 0.28
F32 = npt.NDArray[np.float32]
Way = Callable[[F32, tuple[str, ...], int], list[common_pb2.Prediction]]


def numpy_predictions(
    logits: F32, labels: tuple[str, ...], top_k: int
) -> list[common_pb2.Prediction]:
    """The logits branch as it was before stop 89: float32 softmax, a stable argsort."""
    result = [common_pb2.Prediction() for _ in range(len(logits))]
    probs = softmax(logits)
    k = min(top_k, probs.shape[1])
    best = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    for pred, row, order in zip(result, probs, best, strict=True):
        top = float(row[order[0]])
        pred.score = top
        pred.out_of_scope = top < THRESHOLD
        pred.label = OUT_OF_SCOPE if pred.out_of_scope else labels[order[0]]
        pred.top_k.extend(
            common_pb2.LabelScore(label=labels[i], score=float(row[i])) for i in order
        )
    return result


def python_predictions(
    logits: F32, labels: tuple[str, ...], top_k: int
) -> list[common_pb2.Prediction]:
    return predictions(logits, None, labels, THRESHOLD, top_k)


def _times_us(way: Way, rows: int, calls: int, sweep: F32, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    labels = tuple(f"intent_{i}" for i in range(CLASSES))
    cold, hot = [], []
    for _ in range(calls):
        logits = (rng.standard_normal((rows, CLASSES)) * 4).astype(np.float32)
        sweep.sum()  # as a model run does: the caches hold other data now
        started = time.perf_counter()
        way(logits, labels, 1)
        cold.append((time.perf_counter() - started) * 1e6)
        started = time.perf_counter()
        way(logits, labels, 1)
        hot.append((time.perf_counter() - started) * 1e6)
    return statistics.median(cold), statistics.median(hot)


def _same_answers(rows: int) -> None:
    rng = np.random.default_rng(1)
    labels = tuple(f"intent_{i}" for i in range(CLASSES))
    logits = (rng.standard_normal((rows, CLASSES)) * 4).astype(np.float32)
    for a, b in zip(
        numpy_predictions(logits, labels, 5), python_predictions(logits, labels, 5), strict=True
    ):
        same = (
            a.label == b.label
            and a.out_of_scope == b.out_of_scope
            and [s.label for s in a.top_k] == [s.label for s in b.top_k]
            and np.allclose([s.score for s in a.top_k], [s.score for s in b.top_k], rtol=1e-6)
        )
        if not same:
            raise SystemExit(f"the two ways disagree on a row:\n{a}\nagainst\n{b}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32", help="rows a call, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="calls a way a round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sweep-mb", type=int, default=120)
    args = parser.parse_args()
    sweep = np.ones(args.sweep_mb * 2**20 // 4, dtype=np.float32)
    ways: dict[str, Way] = {"numpy": numpy_predictions, "python": python_predictions}
    for rows in (int(r) for r in args.rows.split(",")):
        _same_answers(rows)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for round_ in range(args.rounds):
            names = list(ways) if round_ % 2 == 0 else list(reversed(ways))
            for name in names:
                results[name].append(_times_us(ways[name], rows, args.calls, sweep, round_))
        for name, pairs in results.items():
            cold = statistics.median(c for c, _ in pairs)
            hot = statistics.median(h for _, h in pairs)
            print(f"{rows:3d} rows  {name:6s}  cold {cold:7.1f} us  hot {hot:7.1f} us")


if __name__ == "__main__":
    main()
