"""`hopline cache pairs` and `hopline cache calibrate` as processes: the chosen threshold
meets its target on the bundled support intents and on CLINC150. The calibration functions
themselves are unit-tested in tests/unit/test_cache_calibrate.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CLINC, check_conservative, false_hit_rate
from hopline.cache.calibrate import calibrate
from hopline.cache.checked_calibration import calibrate_checked
from hopline.cache.embedder import Embedder
from hopline.cache.pairs import Pair, derive_pairs, read_pairs, write_pairs
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


def test_cli_fails_clearly_when_no_threshold_meets_the_target(tmp_path: Path) -> None:
    pairs, png, out = tmp_path / "pairs.jsonl", tmp_path / "pr.png", tmp_path / "cal.json"
    write_pairs(
        [Pair("q1", "c1", False, "a", "b", 0.99), Pair("q2", "c2", True, "a", "a", 0.9)], pairs
    )
    run = _hopline("calibrate", "--pairs", str(pairs), "--target-false-hit-rate", "0.01")
    assert run.returncode == 3, run.stderr
    assert "error: no threshold meets a false-hit rate of 0.01" in run.stderr
    assert "more pairs at these rates would not help" in run.stderr
    assert run.stdout == ""
    # Too few pairs, all right: the refusal says how many more, and still writes both files.
    write_pairs([Pair(f"q{i}", f"c{i}", True, "a", "a", 0.99 - i / 100) for i in range(30)], pairs)
    run = _hopline(
        "calibrate",
        "--pairs",
        str(pairs),
        "--target-false-hit-rate",
        "0.05",
        "--png",
        str(png),
        "--json",
        str(out),
    )
    assert run.returncode == 3, run.stderr
    assert "give about 10 more pairs (40 in all" in run.stderr
    assert run.stdout == ""
    doc = json.loads(out.read_text())
    assert doc["accepted"] is False
    assert doc["refusal"] == "no_threshold"
    assert doc["threshold"] is None
    assert doc["more_pairs_needed"] == 10
    assert doc["reason"] in run.stderr
    assert png.read_bytes()[:8] == PNG_MAGIC
    # --confidence 0 with a low --min-hits: accepted, but never silently.
    run = _hopline(
        "calibrate",
        "--pairs",
        str(pairs),
        "--target-false-hit-rate",
        "0.05",
        "--confidence",
        "0",
        "--min-hits",
        "5",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["accepted"] is True
    assert doc["hits"] < 40
    assert "warning: --confidence 0" in run.stderr
    assert "warning: the threshold rests on" in run.stderr
    assert len(doc["warnings"]) == 2
    assert "(below the evidence rule's 40)" in run.stdout


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
    assert result["accepted"] is True
    # Printed as the shortest decimal that admits exactly the same pairs.
    text = result["config_threshold"]
    assert f"threshold              {text}\n" in run.stdout
    assert result["next_lower_similarity"] < float(text) <= t
    cv = result["cross_validation"]
    assert cv["held_out_false_hit_rate"] <= target
    assert f"held-out false-hit rate {cv['held_out_false_hit_rate']:.4f}" in run.stdout
    sim_list = [float(x) for x in recorded]
    same = [p.same for p in pairs]
    assert result["min_hits"] == math.ceil(2 / target)
    check_conservative(sim_list, same, t, target, result["min_hits"])
    hits, wrong = false_hit_rate(sim_list, same, t)
    assert false_hit_rate(sim_list, same, float(text)) == (hits, wrong)
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
    hits, wrong = false_hit_rate(sims, same, r.threshold)
    check_conservative(sims, same, r.threshold, target, min_hits)
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

    # What `hopline cache calibrate` decides (90% confidence, min hits 2 / target, 5 folds).
    # At 1% the intent labels' noise keeps the bound over the target: a refusal that says
    # how many more pairs the rule needs.
    refused = calibrate_checked(sims, same, 0.01)
    assert not refused.accepted
    assert refused.refusal == "no_threshold"
    assert refused.more_pairs is not None
    assert "more pairs" in refused.reason
    for goal in (0.02, 0.05):
        rep = calibrate_checked(sims, same, goal)
        assert rep.accepted, rep.reason
        cand, cv = rep.candidate, rep.cross_validation
        assert cand is not None
        assert cv is not None
        with capsys.disabled():
            print(
                f"  target {goal}, 90% confidence: threshold {cand.threshold:.4f}, in-sample "
                f"false-hit rate {cand.false_hit_rate:.4f} (bound {cand.false_hit_bound:.4f}), "
                f"held-out {cv.false_hit_rate:.4f} ({cv.false_hits}/{cv.hits}, per fold "
                f"{' '.join(f'{f.false_hit_rate:.4f}' for f in cv.folds)}), hit rate "
                f"{cand.hit_rate:.4f}, held-out hit rate {cv.hit_rate:.4f}"
            )
        assert cv.false_hit_rate <= goal
        assert cv.refused == 0
    with capsys.disabled():
        print(f"  target 0.01, 90% confidence: refused: {refused.reason}")
