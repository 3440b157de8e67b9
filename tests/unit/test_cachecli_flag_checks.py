"""`hopline cache pairs` and `cache calibrate` flags nothing read, or read only after the
work: `pairs --clinc` took --holdout and --seed and split nothing (the file names its store
and query splits), `--model` took --oos-label and labelled by its own answers, --model-version
without --model was ignored, and `calibrate --check-pairs` was read only after the
calibration; `cache eval` dialled a --gateway or --cache address such as 127.0.0.1:87137
(another server's port, wrapped). Each is now a usage error (exit 2) before any work."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hopline.cache.pairs import Pair, write_pairs
from hopline.cli.main import main


def _clinc(tmp_path: Path) -> Path:
    path = tmp_path / "clinc.json"
    rows = [[f"text {i}", "ab"[i % 2]] for i in range(6)]
    path.write_text(json.dumps({"train": rows, "val": rows[:2], "oos_val": [["x", "oos"]]}))
    return path


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        # --clinc names its store and query splits: nothing is held out, nothing shuffled.
        (["--holdout", "0.3"], "--holdout go with --train, not this source"),
        (["--seed", "7"], "--seed go with --train, not this source"),
        (["--holdout", "0.3", "--seed", "7"], "--holdout and --seed go with --train"),
        # With --model the model's answers label the pairs, out-of-scope ones as any other.
        (["--model", "m", "--oos-label", "none"], "--oos-label is the data set's label: not"),
        (["--model-version", "2"], "--model-version goes with --model"),
    ],
)
def test_pairs_flags_nothing_would_read_are_refused(
    flags: list[str],
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def embedder(_: Path) -> Any:
        raise AssertionError("embedded despite a refused flag")

    monkeypatch.setattr("hopline.cache.cli._embedder", embedder)
    out = tmp_path / "pairs.jsonl"
    argv = ["cache", "pairs", "--clinc", str(_clinc(tmp_path)), "--out", str(out), *flags]
    assert main(argv) == 2
    assert f"hopline cache pairs: error: {said}" in capsys.readouterr().err
    assert not out.exists()


def test_pairs_from_a_train_file_holds_out_at_the_given_share_and_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    def embedder(_: Path) -> Any:
        return SimpleNamespace(embed_many=lambda texts: np.eye(len(texts), 8, dtype=np.float32))

    monkeypatch.setattr("hopline.cache.cli._embedder", embedder)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps([f"text {i}", "ab"[i % 2]]) + "\n" for i in range(8)))
    out = tmp_path / "pairs.jsonl"
    argv = ["cache", "pairs", "--train", str(train), "--out", str(out)]
    assert main([*argv, "--holdout", "0.25", "--seed", "3"]) == 0
    assert len(out.read_text().splitlines()) == 2  # a quarter of each label's 4 texts


def test_calibrate_reads_its_check_pairs_before_calibrating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing --check-pairs was said only after the calibration (its embedding minutes)."""

    def calibrate_checked(*args: object) -> object:
        raise AssertionError("calibrated before --check-pairs was read")

    monkeypatch.setattr("hopline.cache.checked_calibration.calibrate_checked", calibrate_checked)
    pairs = tmp_path / "pairs.jsonl"
    write_pairs([Pair(f"q{i}", f"c{i}", True, "a", "a", 0.9) for i in range(4)], pairs)
    missing = tmp_path / "check.jsonl"
    assert main(["cache", "calibrate", "--pairs", str(pairs), "--check-pairs", str(missing)]) == 2
    assert (
        capsys.readouterr().err
        == f"hopline cache calibrate: error: --check-pairs {missing}: no such file\n"
    )


@pytest.mark.parametrize(
    ("flag", "address", "said"),
    [
        ("--gateway", "127.0.0.1:87137", "--gateway '127.0.0.1:87137': the port must be"),
        ("--cache", "127.0.0.1:", "--cache "),
    ],
)
def test_eval_refuses_an_address_that_dials_another_server_before_any_work(
    flag: str,
    address: str,
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Left to gRPC, 127.0.0.1:87137 dialled port 21601, another server (`cache stats` and
    `cache invalidate` checked theirs; `cache eval` did not)."""
    from hopline.model.repository import ModelRepository

    def resolve(*args: object) -> object:
        raise AssertionError("the model was resolved before the address was checked")

    monkeypatch.setattr(ModelRepository, "resolve", resolve)
    argv = ["cache", "eval", "--clinc", str(_clinc(tmp_path)), "--model", "m", flag, address]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"hopline cache eval: error: {said}")
