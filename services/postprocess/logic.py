"""The postprocessing itself, free of gRPC so the in-process baseline runs the same code."""

from __future__ import annotations

import heapq
import math

import numpy as np
import numpy.typing as npt

from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.tensors import to_tensor

OUT_OF_SCOPE = "out_of_scope"


def l2_normalise(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    out: npt.NDArray[np.float32] = (x / np.maximum(norms, 1e-12)).astype(np.float32)
    return out


def predictions(
    logits: npt.NDArray[np.float32] | None,
    embeddings: npt.NDArray[np.float32] | None,
    labels: tuple[str, ...],
    oos_threshold: float,
    top_k: int,
) -> list[common_pb2.Prediction]:
    """One Prediction per row: the best label (or out-of-scope below the threshold), the
    k best labels with softmax scores, and the unit-length embedding when given."""
    rows = len(logits) if logits is not None else len(embeddings)  # type: ignore[arg-type]
    if logits is None:
        result = [common_pb2.Prediction() for _ in range(rows)]
    else:
        result = [_prediction(row, labels, oos_threshold, top_k) for row in logits.tolist()]
    if embeddings is not None:
        for pred, vector in zip(result, l2_normalise(embeddings), strict=True):
            pred.embedding.CopyFrom(to_tensor("embedding", vector))
    return result


def _prediction(
    row: list[float], labels: tuple[str, ...], oos_threshold: float, top_k: int
) -> common_pb2.Prediction:
    """One row's softmax and top k in plain Python, in float64. A request's row comes right
    after its model run swept the caches, where each of numpy's seven small-array calls
    cost about 10 us: one row took 70-90 us that way against 33-38 here (15 against 5-6 hot); a
    32-row batch 195 either way (115 against 128 hot; stop 89,
    `bench/scripts/postprocess_cold.py`). Ties go to the lower class index, as a stable
    sort puts them."""
    best = max(row)
    exps = [math.exp(x - best) for x in row]
    total = sum(exps)
    # nlargest keeps equal scores in index order (and takes max() for k = 1)
    order = heapq.nlargest(min(top_k, len(row)), range(len(row)), key=row.__getitem__)
    top = exps[order[0]] / total
    out_of_scope = top < oos_threshold
    pred = common_pb2.Prediction(
        label=OUT_OF_SCOPE if out_of_scope else labels[order[0]],
        score=top,
        out_of_scope=out_of_scope,
    )
    add = pred.top_k.add
    for i in order:
        add(label=labels[i], score=exps[i] / total)
    return pred
