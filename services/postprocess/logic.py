"""The postprocessing itself, free of gRPC so the in-process baseline runs the same code."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from hopline.model.head import softmax
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
    result = [common_pb2.Prediction() for _ in range(rows)]
    if logits is not None:
        probs = softmax(logits)
        k = min(top_k, probs.shape[1])
        best = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        for pred, row, order in zip(result, probs, best, strict=True):
            top = float(row[order[0]])
            pred.score = top
            pred.out_of_scope = top < oos_threshold
            pred.label = OUT_OF_SCOPE if pred.out_of_scope else labels[order[0]]
            pred.top_k.extend(
                common_pb2.LabelScore(label=labels[i], score=float(row[i])) for i in order
            )
    if embeddings is not None:
        for pred, vector in zip(result, l2_normalise(embeddings), strict=True):
            pred.embedding.CopyFrom(to_tensor("embedding", vector))
    return result
