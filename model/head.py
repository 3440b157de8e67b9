"""The classifier head: softmax regression on L2-normalised sentence embeddings, in numpy.

No torch: the head is a [classes, dim] matrix and a bias, trained full-batch with Adam. The
out-of-scope threshold is calibrated on cross-validated (held-out) predictions, so it reflects
how confident the head is on texts it has not seen rather than on its own training set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class TrainedHead:
    weight: F32  # [classes, dim]
    bias: F32  # [classes]
    train_accuracy: float


def softmax(logits: F32) -> F32:
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    out: F32 = z.astype(np.float32, copy=False)
    return out


def train_head(
    x: F32,
    y: npt.NDArray[np.int64],
    num_classes: int,
    *,
    steps: int = 400,
    lr: float = 0.05,
    l2: float = 1e-4,
    seed: int = 0,
) -> TrainedHead:
    """Multinomial logistic regression with weight decay, full batch, Adam."""
    rng = np.random.default_rng(seed)
    n, dim = x.shape
    w = (rng.standard_normal((num_classes, dim)) * 0.01).astype(np.float32)
    b = np.zeros(num_classes, dtype=np.float32)
    onehot = np.zeros((n, num_classes), dtype=np.float32)
    onehot[np.arange(n), y] = 1.0
    m_w, v_w = np.zeros_like(w), np.zeros_like(w)
    m_b, v_b = np.zeros_like(b), np.zeros_like(b)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    # OpenBLAS is ~10x slower on grad.T @ x (long inner dimension, transposed operand)
    # than on a contiguous x.T @ grad; the gradient step dominates training time.
    xt = np.ascontiguousarray(x.T)
    for t in range(1, steps + 1):
        probs = softmax(x @ w.T + b)
        grad = (probs - onehot) / n  # d(mean cross-entropy)/d(logits)
        g_w = (xt @ grad).T + l2 * w
        g_b = grad.sum(axis=0)
        for p, g, m, v in ((w, g_w, m_w, v_w), (b, g_b, m_b, v_b)):
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            p -= lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    accuracy = float(((x @ w.T + b).argmax(axis=1) == y).mean())
    return TrainedHead(w.astype(np.float32), b.astype(np.float32), accuracy)


@dataclass(frozen=True)
class Fold:
    test: npt.NDArray[np.int64]  # indices held out of this fold's head
    head: TrainedHead


def fold_heads(
    x: F32, y: npt.NDArray[np.int64], num_classes: int, *, folds: int = 5, seed: int = 0
) -> list[Fold]:
    """One head per fold, each trained without the examples it is then judged on."""
    order = np.random.default_rng(seed).permutation(len(y))
    out: list[Fold] = []
    for k in range(folds):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        out.append(Fold(test, train_head(x[train], y[train], num_classes, seed=seed)))
    return out


def heldout_labels(x: F32, folds: list[Fold]) -> npt.NDArray[np.int64]:
    """Each example's label from the head that did not see it (x: any embeddings of them)."""
    labels = np.zeros(sum(len(f.test) for f in folds), dtype=np.int64)
    for f in folds:
        labels[f.test] = (x[f.test] @ f.head.weight.T + f.head.bias).argmax(axis=1)
    return labels


def heldout_max_probs(x: F32, y: npt.NDArray[np.int64], folds: list[Fold]) -> tuple[F32, float]:
    """Cross-validated top softmax score per example, and the cross-validated accuracy."""
    scores = np.zeros(len(y), dtype=np.float32)
    correct = np.zeros(len(y), dtype=bool)
    for f in folds:
        probs = softmax(x[f.test] @ f.head.weight.T + f.head.bias)
        scores[f.test] = probs.max(axis=1)
        correct[f.test] = probs.argmax(axis=1) == y[f.test]
    return scores, float(correct.mean())


def calibrate_oos_threshold(heldout_scores: F32, in_scope_reject_rate: float) -> float:
    """The score below which a text is called out of scope, chosen so that only
    `in_scope_reject_rate` of held-out in-scope texts fall below it."""
    if in_scope_reject_rate <= 0:
        return 0.0
    return float(np.quantile(heldout_scores, in_scope_reject_rate))
