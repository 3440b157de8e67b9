"""`hopline cache pairs` and `hopline cache calibrate`: flags and files that cannot give a
sound threshold are said, in one line naming the flag or the line. Before: `--query-splits
val,val` counted each query twice (pulling the threshold down), a pairs file holding a pair
twice counted it twice, `pairs --train` on a file of splits said "choose one with --split"
though pairs had no --split, `--min-score -3` was taken though `model build` refuses it,
`--min-hits 0` was silently the default, `--folds` above the pairs' count printed empty folds,
and a similarity of 5.4 gave "threshold 5.4", which `model build --cache-threshold` refuses."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from hopline.cache.pairs import Pair, read_pairs, write_pairs
from hopline.cli.main import main


def _embed(texts: Sequence[str]) -> npt.NDArray[np.float32]:
    """A stand-in encoder: a unit vector per text, the same for the same text."""
    rows = [
        np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).normal(size=8)
        for t in texts
    ]
    vectors = np.array(rows, dtype=np.float32)
    out: npt.NDArray[np.float32] = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return out


@pytest.fixture
def no_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cache pairs` without building the bundled encoder (seconds, and its weights)."""

    def embedder(_: Path) -> Any:
        return SimpleNamespace(embed_many=_embed)

    monkeypatch.setattr("hopline.cache.cli._embedder", embedder)


def _clinc(tmp_path: Path) -> Path:
    path = tmp_path / "clinc.json"
    doc = {
        "train": [[f"stored {i}", "ab"[i % 2]] for i in range(6)],
        "val": [[f"asked {i}", "ab"[i % 2]] for i in range(4)],
        "oos_val": [["elsewhere", "oos"]],
    }
    path.write_text(json.dumps(doc))
    return path


def test_pairs_refuses_a_query_split_named_twice(
    tmp_path: Path, no_encoder: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pairs.jsonl"
    argv = ["cache", "pairs", "--clinc", str(_clinc(tmp_path)), "--out", str(out)]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--query-splits", "val,oos_val,val"])
    assert exit_.value.code == 2
    assert (
        "argument --query-splits: names val more than once: each split's queries count once"
        in capsys.readouterr().err
    )
    assert not out.exists()


def test_pairs_reads_a_split_of_a_train_file(
    tmp_path: Path, no_encoder: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # "choose one with --split" is now something `cache pairs --train` can do.
    train = tmp_path / "splits.json"
    rows = [[f"text number {i}", "ab"[i % 2]] for i in range(8)]
    train.write_text(json.dumps({"train": rows, "test": rows[:2]}))
    out = tmp_path / "pairs.jsonl"
    assert main(["cache", "pairs", "--train", str(train), "--out", str(out)]) == 1
    assert "choose one with --split" in capsys.readouterr().err
    assert (
        main(["cache", "pairs", "--train", str(train), "--split", "train", "--out", str(out)]) == 0
    )
    assert len(read_pairs(out)) == 4  # half of the 8 texts queried


@pytest.mark.parametrize(
    ("score", "said"),
    [("-3", "from 0 to 1 (a score)"), ("1.5", "from 0 to 1 (a score)"), ("nan", "a finite number")],
)
def test_pairs_refuses_a_min_score_that_is_no_score(
    score: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cache", "pairs", "--clinc", str(_clinc(tmp_path)), "--out", str(tmp_path / "p")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--model", "m", f"--min-score={score}"])
    assert exit_.value.code == 2
    assert f"argument --min-score: must be {said}, got {score}" in capsys.readouterr().err


def _pairs_file(tmp_path: Path, pairs: list[Pair]) -> Path:
    path = tmp_path / "pairs.jsonl"
    write_pairs(pairs, path)
    return path


def _right(n: int) -> list[Pair]:
    return [Pair(f"q{i}", f"c{i}", True, "a", "a", 0.99 - i / 1000) for i in range(n)]


@pytest.mark.parametrize(("min_hits", "said"), [("0", "got 0"), ("-5", "got -5")])
def test_calibrate_refuses_min_hits_below_one(
    min_hits: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = _pairs_file(tmp_path, _right(50))
    with pytest.raises(SystemExit) as exit_:
        main(["cache", "calibrate", "--pairs", str(pairs), f"--min-hits={min_hits}"])
    assert exit_.value.code == 2
    assert f"argument --min-hits: must be 1 or more, {said}" in capsys.readouterr().err


def test_calibrate_cuts_folds_to_the_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs, out = _pairs_file(tmp_path, _right(7)), tmp_path / "cal.json"
    argv = ["cache", "calibrate", "--pairs", str(pairs), "--json", str(out)]
    main([*argv, "--target-false-hit-rate", "0.5", "--min-hits", "1", "--folds", "10"])
    assert "warning: --folds 10 is more than the 7 pairs: 7 folds, of one pair each\n" in (
        capsys.readouterr().err
    )
    cv = json.loads(out.read_text())["cross_validation"]
    assert cv["folds"] == 7
    assert all(fold["pairs"] == 1 for fold in cv["per_fold"])


@pytest.mark.parametrize("similarity", [5.4, -1.5])
def test_calibrate_refuses_a_similarity_that_is_no_cosine(
    similarity: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    rows = [json.dumps(p.__dict__) for p in _right(30)]
    rows[20] = json.dumps(dict(json.loads(rows[20]), similarity=similarity))
    pairs.write_text("\n".join(rows[:10]) + "\n\n" + "\n".join(rows[10:]) + "\n")
    argv = ["cache", "calibrate", "--pairs", str(pairs), "--target-false-hit-rate", "0.1"]
    assert main([*argv, "--min-hits", "5"]) == 1
    # Line 22: the blank line after the tenth pair counts, as an editor shows it.
    assert capsys.readouterr().err == (
        f"error: {pairs}:22: similarity {similarity:g} is not a cosine (-1 to 1); drop the "
        "similarities to recompute them, or use --reembed\n"
    )


def test_calibrate_takes_rounding_past_one_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = [Pair(f"q{i}", f"c{i}", True, "a", "a", 1.0000001) for i in range(30)]
    out = tmp_path / "cal.json"
    argv = ["cache", "calibrate", "--pairs", str(_pairs_file(tmp_path, pairs))]
    assert main([*argv, "--target-false-hit-rate", "0.1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["threshold"] == 1.0


def test_calibrate_counts_a_repeated_pair_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What `--query-splits val,val` wrote: every pair twice.
    pairs = [*_right(30), Pair("bad", "c", False, "a", "b", 0.95)]
    out = tmp_path / "cal.json"
    path = _pairs_file(tmp_path, pairs + pairs)
    argv = ["cache", "calibrate", "--pairs", str(path), "--target-false-hit-rate", "0.1"]
    main([*argv, "--min-hits", "5", "--json", str(out)])
    assert f"note: {path}: 31 repeated pairs" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["pairs"] == 31
    assert doc["cross_validation"]["held_out_pairs"] == 31


@pytest.mark.parametrize(
    ("source", "flag", "value", "other"),
    [
        ("--clinc", "--split", "val", "--train"),
        ("--train", "--store-split", "train", "--clinc"),
        ("--train", "--query-splits", "val", "--clinc"),
    ],
)
def test_pairs_refuses_the_other_sources_flags(
    source: str,
    flag: str,
    value: str,
    other: str,
    tmp_path: Path,
    no_encoder: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each was silently ignored: `--split val` with --clinc read the default splits."""
    data = _clinc(tmp_path)
    out = tmp_path / "pairs.jsonl"
    argv = ["cache", "pairs", source, str(data), flag, value, "--out", str(out)]
    assert main(argv) == 2
    assert f"{flag} go with {other}, not this source" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("where", ["a directory", "a file in a file"])
def test_pairs_refuses_an_out_it_cannot_write_before_embedding(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--out` was looked at only after every text was embedded (minutes on CLINC150)."""
    embedded: list[int] = []

    def embed_many(texts: Sequence[str]) -> npt.NDArray[np.float32]:
        embedded.append(len(texts))
        return _embed(texts)

    def embedder(_: Path) -> Any:
        return SimpleNamespace(embed_many=embed_many)

    monkeypatch.setattr("hopline.cache.cli._embedder", embedder)
    (tmp_path / "afile").write_text("")
    out = tmp_path if where == "a directory" else tmp_path / "afile" / "pairs.jsonl"
    argv = ["cache", "pairs", "--clinc", str(_clinc(tmp_path)), "--out", str(out)]
    assert main(argv) == 2
    assert f"error: --out {out}: " in capsys.readouterr().err
    assert embedded == []


def test_pairs_refuses_min_score_without_model(
    tmp_path: Path, no_encoder: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was taken and ignored: only --model's answers have scores."""
    out = tmp_path / "pairs.jsonl"
    argv = ["cache", "pairs", "--clinc", str(_clinc(tmp_path)), "--out", str(out)]
    assert main([*argv, "--min-score", "0.5"]) == 2
    assert "--min-score goes with --model" in capsys.readouterr().err
    assert not out.exists()


def test_pairs_names_a_split_the_train_file_does_not_hold(
    tmp_path: Path, no_encoder: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """'choose one with --split' was said to a caller who had given --split nosplit."""
    train = tmp_path / "splits.json"
    train.write_text(json.dumps({"train": [["a text", "a"]], "test": [["b text", "b"]]}))
    argv = ["cache", "pairs", "--train", str(train), "--split", "nosplit"]
    assert main([*argv, "--out", str(tmp_path / "p.jsonl")]) == 1
    assert "not 'nosplit': choose one of them with --split" in capsys.readouterr().err
