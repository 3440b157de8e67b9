"""`hopline cache pairs` and `hopline cache calibrate`: the chosen threshold meets its target."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from conftest import CLINC
from hopline.cache.calibrate import (
    NoThresholdError,
    Pair,
    PairsFileError,
    calibrate,
    derive_pairs,
    read_pairs,
    write_pairs,
)
from hopline.cache.embedder import Embedder
from hopline.model.build import DEFAULT_TRAIN_FILE, default_weights_dir, load_examples
from hopline.services.pipeline import Pipeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One embedding encoder for the module: building it takes seconds."""
    work = tmp_path_factory.mktemp("cache-work")
    # Built in a child process: onnxruntime's optimizer leaks a TemporaryDirectory, and its
    # ResourceWarning would fail whichever test is running when it is collected.
    code = (
        "import sys; from pathlib import Path; "
        "from hopline.cache.embedder import encoder_file; "
        "from hopline.model.build import default_weights_dir; "
        "encoder_file(default_weights_dir(), Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(work)], check=True, timeout=600)
    return work


@pytest.fixture(scope="module")
def embedder(work_dir: Path) -> Embedder:
    return Embedder.load(default_weights_dir(), work_dir)


def _hopline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hopline", "cache", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _false_hit_rate(sims: Sequence[float], same: Sequence[bool], t: float) -> tuple[int, int]:
    """(hits, false hits) at threshold t, counted the slow, obvious way."""
    hits = [s for s, ok in zip(sims, same, strict=True) if s >= t]
    wrong = [s for s, ok in zip(sims, same, strict=True) if s >= t and not ok]
    return len(hits), len(wrong)


def _check_conservative(
    sims: Sequence[float], same: Sequence[bool], t: float, target: float, min_hits: int = 1
) -> None:
    hits, wrong = _false_hit_rate(sims, same, t)
    assert hits > 0
    assert wrong / hits <= target
    for u in sorted({s for s in sims if s > t}):
        h, w = _false_hit_rate(sims, same, u)
        if h >= min_hits:
            assert w / h <= target, f"threshold {u} above the chosen {t} misses the target"
    lower = [s for s in sims if s < t]
    if lower:
        h, w = _false_hit_rate(sims, same, max(lower))
        assert w / h > target, "the next lower threshold also meets the target: not the lowest"


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
    _check_conservative(sims, same, r.threshold, 0.05, 20)


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
    _check_conservative(sims, same, r.threshold, 0.2)
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
            h, w = _false_hit_rate(sims.tolist(), same.tolist(), top)
            assert w / h > target
            continue
        _check_conservative(sims.tolist(), same.tolist(), r.threshold, target)
        hits, wrong = _false_hit_rate(sims.tolist(), same.tolist(), r.threshold)
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


def test_cli_fails_clearly_when_no_threshold_meets_the_target(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    write_pairs(
        [Pair("q1", "c1", False, "a", "b", 0.99), Pair("q2", "c2", True, "a", "a", 0.9)], pairs
    )
    run = _hopline("calibrate", "--pairs", str(pairs), "--target-false-hit-rate", "0.01")
    assert run.returncode == 3, run.stderr
    assert "error: no threshold meets a false-hit rate of 0.01" in run.stderr
    assert run.stdout == ""


# --- the bundled support intents, end to end through the CLI -------------------------------


def test_calibrate_support_intents_through_the_cli(
    tmp_path: Path, work_dir: Path, embedder: Embedder
) -> None:
    pairs_file, png, out = tmp_path / "pairs.jsonl", tmp_path / "pr.png", tmp_path / "cal.json"
    target = 0.05
    run = _hopline(
        "pairs",
        "--train",
        str(DEFAULT_TRAIN_FILE),
        "--holdout",
        "0.5",
        "--out",
        str(pairs_file),
        "--work-dir",
        str(work_dir),
    )
    assert run.returncode == 0, run.stderr
    examples = load_examples(DEFAULT_TRAIN_FILE)
    pairs = read_pairs(pairs_file)
    assert len(pairs) == len(examples) // 2  # 24 per label, 12 queried

    # Each candidate is the query's nearest neighbour among the texts not held out, with
    # the cosine the file records.
    queried = {p.query for p in pairs}
    store = [(t, label) for t, label in examples if t not in queried]
    assert len(store) == len(examples) - len(pairs)
    s = embedder.embed_many([t for t, _ in store])
    q = embedder.embed_many([p.query for p in pairs])
    sims = q @ s.T
    nearest = [store[i] for i in np.argmax(sims, axis=1)]
    assert [(p.candidate, p.candidate_label) for p in pairs] == nearest
    recorded = np.array([p.similarity for p in pairs])
    np.testing.assert_allclose(recorded, sims.max(axis=1), atol=1e-5)
    assert all(p.same == (p.query_label == p.candidate_label) for p in pairs)

    run = _hopline(
        "calibrate",
        "--pairs",
        str(pairs_file),
        "--target-false-hit-rate",
        str(target),
        "--confidence",
        "0",  # the measured rate itself, so the brute-force checks below apply
        "--png",
        str(png),
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    t = result["threshold"]
    assert f"threshold              {t:.4f}" in run.stdout
    sim_list = [float(x) for x in recorded]
    same = [p.same for p in pairs]
    assert result["min_hits"] == math.ceil(2 / target)
    _check_conservative(sim_list, same, t, target, result["min_hits"])
    hits, wrong = _false_hit_rate(sim_list, same, t)
    assert (result["hits"], result["false_hits"], result["pairs"]) == (hits, wrong, len(pairs))
    assert result["precision"] == pytest.approx(1 - wrong / hits)
    assert result["recall"] == pytest.approx((hits - wrong) / sum(same))
    assert result["hit_rate"] == pytest.approx(hits / len(pairs))
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_model_labelled_pairs_follow_the_models_answers_and_store_policy(
    tmp_path: Path, work_dir: Path, embedder: Embedder, default_repo: Path
) -> None:
    """`pairs --model`: labels are the model's answers (what `cache eval` counts as a
    cache-induced error), and the cached side holds only what the policy would store."""
    pairs_file = tmp_path / "pairs.jsonl"
    pipeline = Pipeline.load(default_repo, "support-intents")
    examples = load_examples(DEFAULT_TRAIN_FILE)
    # The median answer score: the bound drops about half of the store texts.
    min_score = float(np.median([p.score for p in pipeline.predict_many([t for t, _ in examples])]))
    run = _hopline(
        "pairs",
        "--train",
        str(DEFAULT_TRAIN_FILE),
        "--holdout",
        "0.5",
        "--model",
        "support-intents",
        "--model-repo",
        str(default_repo),
        "--min-score",
        repr(min_score),
        "--out",
        str(pairs_file),
        "--work-dir",
        str(work_dir),
    )
    assert run.returncode == 0, run.stderr
    pairs = read_pairs(pairs_file)
    queried = {p.query for p in pairs}
    store = [t for t, _ in examples if t not in queried]
    answers = {t: p for t, p in zip(store, pipeline.predict_many(store), strict=True)}
    kept = [t for t in store if answers[t].score >= min_score and not answers[t].out_of_scope]
    assert 0 < len(kept) < len(store), "the min score should drop some store texts, not all"
    assert f"{len(kept)} of {len(store)} store texts kept" in run.stdout

    q_answers = pipeline.predict_many([p.query for p in pairs])
    assert [p.query_label for p in pairs] == [a.label for a in q_answers]
    assert all(p.candidate in kept for p in pairs)
    assert [p.candidate_label for p in pairs] == [answers[p.candidate].label for p in pairs]
    assert all(p.same == (p.query_label == p.candidate_label) for p in pairs)
    # Nearest among the kept texts only.
    sims = embedder.embed_many([p.query for p in pairs]) @ embedder.embed_many(kept).T
    assert [p.candidate for p in pairs] == [kept[i] for i in np.argmax(sims, axis=1)]


# --- CLINC150 -------------------------------------------------------------------------------


@pytest.mark.slow
def test_calibrate_clinc150(embedder: Embedder, capsys: pytest.CaptureFixture[str]) -> None:
    if not CLINC.is_file():
        pytest.skip(f"CLINC150 not found at {CLINC} (../shared/data is absent)")
    data = json.loads(CLINC.read_text(encoding="utf-8"))
    store = [(t, label) for t, label in data["train"]]
    queries = [(t, label) for t, label in data["val"] + data["oos_val"]]
    started = time.perf_counter()
    pairs = derive_pairs(embedder.embed_many, store, queries)
    derived_s = time.perf_counter() - started
    sims = [float(p.similarity or 0.0) for p in pairs]
    same = [p.same for p in pairs]
    target = 0.01
    min_hits = math.ceil(2 / target)  # what `hopline cache calibrate` uses
    r = calibrate(sims, same, target, min_hits)
    hits, wrong = _false_hit_rate(sims, same, r.threshold)
    _check_conservative(sims, same, r.threshold, target, min_hits)
    with capsys.disabled():
        print(
            f"\nCLINC150 cache calibration (store train={len(store)}, queries val+oos_val="
            f"{len(queries)}, pairs={r.pairs} of which same={r.same_pairs}, "
            f"exact repeats skipped={len(queries) - len(pairs)}, {derived_s:.1f} s to derive)\n"
            f"  target false-hit rate {target} (min hits {min_hits}): threshold {r.threshold:.4f} "
            f"precision {r.precision:.4f} recall {r.recall:.4f} hit rate {r.hit_rate:.4f} "
            f"hits {r.hits} false hits {r.false_hits}"
        )
        for u in (0.95, 0.9, 0.85, 0.8):
            p = r.curve.at(u)
            print(f"  at {u:.2f}: false-hit rate {p.false_hit_rate:.4f} hit rate {p.hit_rate:.4f}")
    assert (hits, wrong) == (r.hits, r.false_hits)
    assert wrong / hits <= target
    assert r.hit_rate > 0
