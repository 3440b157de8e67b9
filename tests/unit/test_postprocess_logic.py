"""`services/postprocess/logic.py:predictions` against a float64 numpy softmax of the same
logits: scores, order, ties, the out-of-scope threshold, rows alone and in a batch."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from hopline.services.postprocess.logic import OUT_OF_SCOPE, predictions

LABELS = tuple(f"intent_{i}" for i in range(26))


def _reference(row: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    z = np.exp(row.astype(np.float64) - row.max())
    out: npt.NDArray[np.float64] = z / z.sum()
    return out


@pytest.mark.parametrize("top_k", [1, 3, 26])
def test_scores_and_order_match_a_softmax_of_the_logits(top_k: int) -> None:
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((5, len(LABELS))) * 4).astype(np.float32)
    for pred, row in zip(predictions(logits, None, LABELS, 0.0, top_k), logits, strict=True):
        probs = _reference(row)
        want = np.argsort(-probs, kind="stable")[:top_k]
        assert [s.label for s in pred.top_k] == [LABELS[i] for i in want]
        assert np.allclose([s.score for s in pred.top_k], probs[want], rtol=1e-6)
        assert pred.label == LABELS[want[0]]
        assert pred.score == pred.top_k[0].score
        assert not pred.out_of_scope


def test_ties_go_to_the_lower_class_index() -> None:
    logits = np.zeros((1, len(LABELS)), dtype=np.float32)
    logits[0, [4, 9, 17]] = 2.0
    (one,) = predictions(logits, None, LABELS, 0.0, 1)
    (three,) = predictions(logits, None, LABELS, 0.0, 3)
    assert one.label == LABELS[4]
    assert [s.label for s in three.top_k] == [LABELS[4], LABELS[9], LABELS[17]]


def test_a_top_score_below_the_threshold_is_out_of_scope_with_its_labels_kept() -> None:
    flat = np.zeros((1, len(LABELS)), dtype=np.float32)
    flat[0, 3] = 0.5  # softmax top about 0.06
    (pred,) = predictions(flat, None, LABELS, 0.28, 2)
    assert pred.out_of_scope
    assert pred.label == OUT_OF_SCOPE
    assert pred.top_k[0].label == LABELS[3]
    sure = np.zeros((1, len(LABELS)), dtype=np.float32)
    sure[0, 3] = 10.0
    (pred,) = predictions(sure, None, LABELS, 0.28, 1)
    assert not pred.out_of_scope
    assert pred.label == LABELS[3]


def test_a_row_in_a_batch_gets_what_it_gets_alone() -> None:
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((8, len(LABELS))) * 4).astype(np.float32)
    batch = predictions(logits, None, LABELS, 0.28, 3)
    alone = [predictions(logits[i : i + 1], None, LABELS, 0.28, 3)[0] for i in range(8)]
    assert batch == alone


def test_embeddings_come_back_unit_length_beside_the_scores() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((2, len(LABELS))).astype(np.float32)
    embeddings = (rng.standard_normal((2, 8)) * 3).astype(np.float32)
    for pred in predictions(logits, embeddings, LABELS, 0.0, 1):
        vector = np.frombuffer(pred.embedding.raw, dtype=np.float32)
        assert pred.label
        assert np.isclose(np.linalg.norm(vector), 1.0, atol=1e-6)
