"""The check a converted build must pass against FP32 (hopline.model.quantize), on made-up
outputs so each limit is tried on its own; the real builds are tests/mesh/test_precision_build.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from hopline.model.quantize import CheckLimits, Outputs, Precision, compare, cosines

RNG = np.random.default_rng(0)
TEXTS = 200


def _unit(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def _outputs(noise: float, labels: np.ndarray, base: np.ndarray, sentences: np.ndarray) -> Outputs:
    def jitter(x: np.ndarray) -> np.ndarray:
        return _unit(x + noise * RNG.standard_normal(x.shape).astype(np.float32))

    return Outputs(jitter(base), labels, jitter(sentences))


BASE = _unit(RNG.standard_normal((TEXTS, 16)).astype(np.float32))
SENTENCES = _unit(RNG.standard_normal((5, 16)).astype(np.float32))
TRUTH = RNG.integers(0, 4, TEXTS)
NAMES = ["a", "b", "", "?", "long"]


def _check(
    noise: float, flipped_heldout: int = 0, flipped_train: int = 0, wrong_after: int = 0
) -> list[str]:
    reference = Outputs(BASE, TRUTH.copy(), SENTENCES)
    train = TRUTH.copy()
    train[:flipped_train] = (train[:flipped_train] + 1) % 4
    candidate = _outputs(noise, train, BASE, SENTENCES)
    fp32_heldout = TRUTH.copy()
    heldout = TRUTH.copy()
    # Flips that move a right answer to a wrong one cost accuracy; the rest swap wrong answers.
    heldout[:wrong_after] = (heldout[:wrong_after] + 1) % 4
    fp32_heldout[wrong_after:flipped_heldout] = (fp32_heldout[wrong_after:flipped_heldout] + 1) % 4
    heldout[wrong_after:flipped_heldout] = (heldout[wrong_after:flipped_heldout] + 2) % 4
    result = compare(
        Precision.INT8, reference, candidate, (fp32_heldout, heldout), TRUTH, NAMES, "made up"
    )
    assert result.heldout_labels_changed == flipped_heldout
    assert result.train_labels_changed == flipped_train
    return result.failures(CheckLimits())


def test_a_close_conversion_passes() -> None:
    assert _check(noise=0.01) == []


def test_a_changed_embedding_is_refused_naming_the_sentence() -> None:
    (failure, *rest) = _check(noise=0.3)
    assert "mean embedding cosine" in failure
    assert any("for '" in f for f in rest)


def test_label_flips_beyond_the_limit_are_refused() -> None:
    # 1% may flip (2 of 200) when the accuracy holds; 3 may not.
    assert _check(noise=0.01, flipped_heldout=2) == []
    assert _check(noise=0.01, flipped_heldout=3) == ["held-out label agreement 0.9850 < 0.99"]


def test_lost_accuracy_is_refused_even_when_few_labels_flip() -> None:
    # 2 of 200 right answers turned wrong: 1 point of held-out accuracy, over the 0.5 limit.
    (failure,) = _check(noise=0.01, flipped_heldout=2, wrong_after=2)
    assert "held-out accuracy 0.9900 is 0.0100 below FP32's 1.0000" in failure


def test_the_shipped_head_must_keep_its_training_labels() -> None:
    assert _check(noise=0.01, flipped_train=3) == ["training-text label agreement 0.9850 < 0.99"]


def test_cosines_are_per_row() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    b = np.array([[1.0, 1.0], [0.0, -1.0]], np.float32)
    assert cosines(a, b) == pytest.approx([2**-0.5, -1.0])
