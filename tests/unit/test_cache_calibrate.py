"""`hopline cache calibrate`'s threshold choice and `cache pairs`' pair derivation, as
functions on hand-made data. The CLI, with the bundled model's encoder and CLINC150, is
tests/mesh/test_cache_calibrate_cli.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from conftest import check_conservative, false_hit_rate
from hopline.cache.calibrate import NoThresholdError, calibrate, pairs_needed
from hopline.cache.calibration_report import (
    config_threshold,
    digits_of,
    floor_text,
    plot,
    plot_range,
    to_json,
)
from hopline.cache.checked_calibration import calibrate_checked
from hopline.cache.cross_validation import fold_ids
from hopline.cache.keys import normalise_text
from hopline.cache.pairs import (
    Pair,
    PairsFileError,
    derive_pairs,
    pair_similarities,
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


# --- the evidence rule, cross-validation and the refusal -----------------------------------


def test_a_threshold_never_rests_on_fewer_hits_than_min_hits() -> None:
    # The issue: --confidence 0 accepted 0.99 on its single (right) hit, below its min-hits.
    sims, same = [0.99, 0.5, 0.4], [True, False, False]
    with pytest.raises(NoThresholdError, match="at least 40 hits: there are only 3 pairs") as e:
        calibrate(sims, same, 0.05, min_hits=40)
    assert e.value.curve is not None
    assert e.value.curve.pairs == 3
    assert calibrate(sims, same, 0.05).threshold == 0.99  # min_hits=1 still allows it


@pytest.mark.parametrize(("p", "target", "confidence"), [(0.02, 0.05, 0.9), (0.0, 0.01, 0.9)])
def test_pairs_needed_is_where_the_wilson_bound_meets_the_target(
    p: float, target: float, confidence: float
) -> None:
    # One usable threshold: half the pairs hit, a share p of the hits wrong; the other half
    # are all wrong.
    hits = 200
    sims = np.r_[np.full(hits, 0.9), np.full(hits, 0.1)]
    same = np.r_[np.arange(hits) >= round(p * hits), np.zeros(hits, dtype=bool)]
    r = calibrate(sims, same, 0.9, 1)  # any curve: pairs_needed reads only the counts
    z = NormalDist().inv_cdf(confidence)
    needed = pairs_needed(r.curve, target, 1, confidence)
    assert needed is not None
    n = needed / 2  # hits at the hit rate 1/2

    def wilson(n: float) -> float:  # the bound at rate p on n hits, n real
        return float(
            (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)))
            / (1 + z * z / n)
        )

    assert wilson(n) <= target + 1e-9
    assert wilson(n - 1) > target
    # Over the target, no count helps; the min-hits floor applies.
    assert pairs_needed(r.curve, p / 2, 1, confidence) is None
    assert pairs_needed(r.curve, 0.3, 5000, confidence) == 10000


def test_confidence_bounds_are_not_vetoes() -> None:
    # 100 hits with 3 wrong at the top (the 30th, 60th, 90th): at 40 hits the bound is over
    # 5%, the measured rate 2.5%. Below them 1900 pairs at about 2%: the lower threshold,
    # holding those hits and more, is the better evidence.
    rng = np.random.default_rng(3)
    sims = np.r_[np.linspace(0.99, 0.95, 100), np.linspace(0.94, 0.5, 1900)]
    same = np.r_[~np.isin(np.arange(100), [29, 59, 89]), rng.uniform(size=1900) > 0.02]
    r = calibrate(sims, same, 0.05, min_hits=40, confidence=0.9)
    assert r.threshold < 0.9
    assert r.false_hit_bound <= 0.05


def _flat_pairs(n: int, wrong_rate: float, seed: int) -> tuple[Any, Any]:
    """Pairs whose false-hit chance is the same at every similarity."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.3, 1.0, n), rng.uniform(size=n) >= wrong_rate


def test_an_overfit_threshold_is_refused_on_its_held_out_rate() -> None:
    # Every region is 8% wrong: no threshold truly meets 5%. With --confidence 0 and a low
    # --min-hits the top of the curve passes by luck; the folds show it does not hold.
    sims, same = _flat_pairs(3000, 0.08, seed=11)
    report = calibrate_checked(sims, same, 0.05, min_hits=20, confidence=0.0)
    assert report.candidate is not None, "the noise should let an in-sample threshold through"
    assert report.candidate.false_hit_rate <= 0.05
    assert not report.accepted
    assert report.refusal == "held_out"
    cv = report.cross_validation
    assert cv is not None
    assert cv.false_hit_rate > 0.05
    assert "held-out false-hit rate" in report.reason
    assert report.threshold is None
    # Out of sample for real: a fresh sample from the same source misses too.
    fresh_s, fresh_y = _flat_pairs(20000, 0.08, seed=12)
    hit = fresh_s >= report.candidate.threshold
    assert (hit & ~fresh_y).sum() / hit.sum() > 0.05
    # Both warnings: the measured rate, and a threshold resting on fewer hits than 2/target.
    assert any("--confidence 0" in w for w in report.warnings)
    if report.candidate.hits < 40:
        assert any("fewer than the evidence rule's 40" in w for w in report.warnings)


def test_a_sound_threshold_is_accepted_and_holds_on_a_fresh_sample() -> None:
    # 2% wrong at every similarity, target 5%: the whole range is fine.
    sims, same = _flat_pairs(3000, 0.02, seed=5)
    report = calibrate_checked(sims, same, 0.05)
    assert report.accepted, report.reason
    assert report.warnings == ()
    cv = report.cross_validation
    assert cv is not None
    assert len(cv.folds) == 5
    assert cv.pairs == 3000
    assert cv.false_hit_rate <= 0.05
    assert report.threshold is not None
    fresh_s, fresh_y = _flat_pairs(20000, 0.02, seed=6)
    hit = fresh_s >= report.threshold
    assert (hit & ~fresh_y).sum() / hit.sum() <= 0.05
    # The JSON keeps the old keys, adds the decision and the held-out figures.
    doc = to_json(report)
    for key in ("threshold", "false_hit_rate", "precision", "recall", "hit_rate", "hits"):
        assert doc[key] is not None
    assert doc["accepted"] is True
    assert doc["cross_validation"]["held_out_false_hit_rate"] == cv.false_hit_rate
    assert len(doc["cross_validation"]["per_fold"]) == 5


def test_too_few_pairs_refuse_with_the_count_the_rule_needs() -> None:
    sims, same = _flat_pairs(30, 0.0, seed=1)  # all right, but 30 hits < 2 / 0.05
    report = calibrate_checked(sims, same, 0.05)
    assert not report.accepted
    assert report.refusal == "no_threshold"
    # min_hits 40 at a hit rate of 1, and the 90% bound at rate 0 needs 32: 40 pairs.
    assert report.pairs_needed == 40
    assert report.more_pairs == 10
    assert "give about 10 more pairs (40 in all" in report.reason
    doc = to_json(report)
    assert doc["accepted"] is False
    assert doc["threshold"] is None
    assert doc["more_pairs_needed"] == 10
    assert doc["curve"]["hits"][-1] == 30


def test_a_low_min_hits_is_allowed_with_a_warning() -> None:
    sims, same = _flat_pairs(30, 0.0, seed=1)
    report = calibrate_checked(sims, same, 0.05, min_hits=10, confidence=0.5)
    assert report.accepted
    assert report.candidate is not None
    assert report.candidate.hits < 40
    assert any("fewer than the evidence rule's 40" in w for w in report.warnings)
    assert to_json(report)["warnings"] == list(report.warnings)


def test_folds_are_seeded_and_stratified() -> None:
    sims, same = _flat_pairs(1003, 0.1, seed=2)
    a, b = fold_ids(sims, same, 5, 0), fold_ids(sims, same, 5, 0)
    assert (a == b).all()
    assert not (a == fold_ids(sims, same, 5, 1)).all()
    sizes = np.bincount(a, minlength=5)
    assert sizes.max() - sizes.min() <= 1
    wrong = np.bincount(a[~same], minlength=5)
    assert wrong.max() - wrong.min() <= 1


def test_printed_thresholds_differ_and_admit_the_same_pairs() -> None:
    # The "1.0000" beside "next lower threshold 1.000000".
    assert config_threshold(1.0, 0.99999994) == "1.0000"
    assert floor_text(0.99999994, 4) == "0.9999"
    assert config_threshold(0.91236, 0.91234) == "0.91236"
    assert config_threshold(0.91236, 0.5) == "0.9123"
    for t, lower in ((0.91236, 0.912358), (0.8, 0.79), (0.7000001, 0.7)):
        text = config_threshold(t, lower)
        assert lower < float(text) <= t
        assert floor_text(lower, digits_of(text)) != text


def test_the_plot_zooms_to_the_decision(tmp_path: Path) -> None:
    sims, same = _flat_pairs(3000, 0.0, seed=4)
    # Wrong answers grow below 0.8: the decision at 5% lies above about 0.7.
    same = same & ~((sims < 0.8) & (np.random.default_rng(0).uniform(size=sims.size) < 0.5))
    report = calibrate_checked(sims, same, 0.05)
    lo, hi = plot_range(report)
    assert report.candidate is not None
    assert 0.6 < lo < report.candidate.threshold
    assert hi >= 1.0
    plot(report, tmp_path / "pr.png")
    assert (tmp_path / "pr.png").read_bytes()[:4] == b"\x89PNG"


def test_pairs_embed_the_text_the_service_embeds() -> None:
    seen: list[str] = []

    def embed(texts: Sequence[str]) -> npt.NDArray[np.float32]:
        seen.extend(texts)
        return _toy_embed(texts)

    store = [("A0  Stored", "x"), ("a90", "y")]
    queries = [("a10\tQuery ", "x"), ("\uff2180", "y")]  # a full-width A: lower-cased
    pairs = derive_pairs(embed, store, queries)
    assert seen
    assert all(t == normalise_text(t) for t in seen)
    assert [p.query for p in pairs] == ["a10\tQuery ", "\uff2180"]  # the file keeps the text
    seen.clear()
    sims = pair_similarities(embed, pairs)
    assert all(t == normalise_text(t) for t in seen)
    assert sims.tolist() == pytest.approx([p.similarity for p in pairs], abs=1e-6)
