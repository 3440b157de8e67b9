"""`hopline cache calibrate`'s threshold choice and `cache pairs`' pair derivation, as
functions on hand-made data. The CLI, with the bundled model's encoder and CLINC150, is
tests/mesh/test_cache_calibrate_cli.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from conftest import check_conservative, false_hit_rate
from hopline.cache.calibrate import (
    NoThresholdError,
    Pair,
    PairsFileError,
    calibrate,
    derive_pairs,
    read_pairs,
    write_pairs,
)

# --- calibrate() on hand-made arrays -------------------------------------------------------


def test_min_hits_keeps_a_noisy_top_from_vetoing_a_sound_lower_threshold() -> None:
    # One wrong pair at the very top (1 of 1, then 1 of 2...), then 40 right ones.
    sims = [0.99, *[0.98 - i * 0.01 for i in range(40)]]
    same = [False, *([True] * 40)]
    with pytest.raises(NoThresholdError):
        calibrate(sims, same, 0.05)  # strict: the top point vetoes everything below
    r = calibrate(sims, same, 0.05, min_hits=20)
    assert r.false_hits == 1
    assert r.hits == 41
    assert r.threshold == pytest.approx(sims[-1])
    check_conservative(sims, same, r.threshold, 0.05, 20)


def test_calibrate_picks_the_lowest_threshold_that_meets_the_target() -> None:
    sims = [0.9, 0.8, 0.7, 0.6, 0.5]
    same = [True, True, False, True, False]
    r = calibrate(sims, same, 0.3)  # 0.7 lets in 1 wrong of 3 hits: 0.33
    assert (r.threshold, r.hits, r.false_hits, r.pairs, r.same_pairs) == (0.8, 2, 0, 5, 3)
    assert r.precision == 1.0
    assert r.recall == pytest.approx(2 / 3)
    assert r.hit_rate == pytest.approx(2 / 5)
    r = calibrate(sims, same, 0.34)  # 0.7: 1/3, 0.6: 1/4, 0.5: 2/5
    assert (r.threshold, r.hits, r.false_hits) == (0.6, 4, 1)
    assert r.false_hit_rate == pytest.approx(0.25)
    assert r.precision == pytest.approx(0.75)
    assert r.recall == 1.0
    assert r.hit_rate == pytest.approx(0.8)


def test_calibrate_ignores_a_lucky_dip_below_a_violation() -> None:
    sims = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6]
    same = [True, False, True, True, True, True, False]
    # False-hit rate from the top: 0, 1/2, 1/3, 1/4, 1/5, 1/6, 2/7. At 0.2 the naive
    # lowest-passing threshold is 0.7 (1/6), but 0.9 above it fails: only 0.95 is safe.
    r = calibrate(sims, same, 0.2)
    assert (r.threshold, r.hits, r.false_hits) == (0.95, 1, 0)
    check_conservative(sims, same, r.threshold, 0.2)
    # Once the target covers the worst point above, everything below is reachable too.
    r = calibrate(sims, same, 0.5)
    assert (r.threshold, r.hits, r.false_hits) == (0.6, 7, 2)


def test_calibrate_admits_ties_together() -> None:
    # At 0.9 both tied pairs hit, one wrong: 0.5 > 0.4, and nothing above 0.9 exists.
    with pytest.raises(NoThresholdError, match="no threshold meets"):
        calibrate([0.9, 0.9, 0.8], [True, False, True], 0.4)
    r = calibrate([0.9, 0.9, 0.8], [True, False, True], 0.5)
    assert (r.threshold, r.hits, r.false_hits) == (0.8, 3, 1)


def test_calibrate_reports_when_no_threshold_meets_the_target() -> None:
    with pytest.raises(NoThresholdError, match=r"no threshold meets a false-hit rate of 0\.01"):
        calibrate([0.99, 0.9, 0.8], [False, True, True], 0.01)


@pytest.mark.parametrize(
    ("sims", "same", "target", "message"),
    [
        ([], [], 0.01, "no pairs"),
        ([0.9, 0.8], [False, False], 0.01, "no same-answer pairs"),
        ([0.9], [True], 0.0, r"must be in \(0, 1\)"),
        ([0.9], [True], 1.0, r"must be in \(0, 1\)"),
        ([0.9], [True], -0.5, r"must be in \(0, 1\)"),
        ([0.9, 0.8], [True], 0.01, "2 similarities but 1 labels"),
        ([float("nan")], [True], 0.01, "finite"),
    ],
)
def test_calibrate_rejects_bad_input(
    sims: list[float], same: list[bool], target: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        calibrate(sims, same, target)


def test_calibrate_matches_brute_force_on_random_pairs() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(5, 60))
        # Rounded so that ties occur.
        sims: npt.NDArray[np.float64] = np.round(rng.uniform(0.2, 1.0, n), 2)
        same = rng.uniform(size=n) < sims  # more similar, more often right
        if not same.any():
            continue
        target = float(rng.choice([0.05, 0.1, 0.2, 0.3]))
        try:
            r = calibrate(sims, same, target)
        except NoThresholdError:
            top = sims.max()
            h, w = false_hit_rate(sims.tolist(), same.tolist(), top)
            assert w / h > target
            continue
        check_conservative(sims.tolist(), same.tolist(), r.threshold, target)
        hits, wrong = false_hit_rate(sims.tolist(), same.tolist(), r.threshold)
        assert (r.hits, r.false_hits) == (hits, wrong)
        assert r.recall == pytest.approx((hits - wrong) / same.sum())


def _wilson_upper(wrong: int, hits: int, z: float) -> float:
    p = wrong / hits
    return (p + z * z / (2 * hits) + z * math.sqrt(p * (1 - p) / hits + z * z / (4 * hits**2))) / (
        1 + z * z / hits
    )


def test_confidence_compares_the_upper_bound_with_the_target() -> None:
    # 2000 pairs: 2 wrong among the 600 most similar, then one wrong in every 25 below.
    # The measured rate stays <= 2% down to the 1100th pair; its upper bound does not.
    sims = np.linspace(0.99, 0.5, 2000)
    same = np.ones(2000, dtype=bool)
    same[[200, 400]] = False
    same[624::25] = False
    target, min_hits = 0.02, 100
    point = calibrate(sims, same, target, min_hits)
    bounded = calibrate(sims, same, target, min_hits, confidence=0.9)
    assert bounded.threshold > point.threshold, "the bound must be the stricter rule"
    assert bounded.confidence == 0.9
    z = 1.2815515655446004  # one-sided 90%
    assert bounded.false_hit_bound == pytest.approx(
        _wilson_upper(bounded.false_hits, bounded.hits, z)
    )
    assert bounded.false_hit_bound <= target
    # The next lower threshold's bound misses the target (else it would have been chosen).
    lower = bounded.curve.at(float(sims[sims < bounded.threshold].max()))
    assert _wilson_upper(lower.false_hits, lower.hits, z) > target
    # The measured rate at the point-estimate choice is within target but its bound is not.
    assert point.false_hit_rate <= target < _wilson_upper(point.false_hits, point.hits, z)
    with pytest.raises(NoThresholdError, match="with 99% confidence: the lowest upper bound"):
        calibrate(sims[:300], same[:300], 0.01, min_hits, confidence=0.99)
    with pytest.raises(ValueError, match="confidence must be in"):
        calibrate(sims, same, target, confidence=1.0)


def test_curve_at_any_threshold() -> None:
    r = calibrate([0.9, 0.8, 0.7], [True, False, True], 0.5)
    assert r.curve.at(0.95).hits == 0
    assert (r.curve.at(0.85).hits, r.curve.at(0.8).hits, r.curve.at(0.0).hits) == (1, 2, 3)
    assert r.curve.at(0.75).false_hits == 1


# --- pairs ---------------------------------------------------------------------------------


def _toy_embed(texts: Sequence[str]) -> npt.NDArray[np.float32]:
    """Texts named after points on the unit circle: 'a30' is the angle 30 degrees."""
    angles = np.radians([float(t.split()[0][1:]) for t in texts])
    return np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def test_derive_pairs_returns_each_querys_nearest_stored_text() -> None:
    store = [("a0", "x"), ("a90", "y"), ("a180", "z")]
    queries = [("a10", "x"), ("a80", "x"), ("a170 question", "oos"), ("a0", "x")]
    pairs = derive_pairs(_toy_embed, store, queries)
    # "a0" repeats a stored text: the exact tier answers it, so it is no pair.
    assert [(p.query, p.candidate, p.same) for p in pairs] == [
        ("a10", "a0", True),
        ("a80", "a90", False),
        ("a170 question", "a180", False),  # out of scope never matches
    ]
    assert pairs[0].similarity == pytest.approx(math.cos(math.radians(10)), abs=1e-6)


def test_pairs_file_round_trip_and_errors(tmp_path: Path) -> None:
    pairs = [Pair("q", "c", True, "a", "a", 0.5), Pair("q2", "c2", False, "a", "b")]
    path = tmp_path / "pairs.jsonl"
    write_pairs(pairs, path)
    assert read_pairs(path) == pairs
    path.write_text(path.read_text() + '{"query": "q3", "same": "yes"}\n')
    with pytest.raises(PairsFileError, match=r"pairs\.jsonl:3: needs strings"):
        read_pairs(path)
