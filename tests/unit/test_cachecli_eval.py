"""`hopline cache eval`'s flags and figures, without a mesh. Before: `--concurrency 0` warmed
nothing yet reported `warmed: 100` (the texts it was given), `--max-intents -1` kept all
intents but one, `--exact-repeats -5` resent all stored misses but five, and
`--verified-model` took a model with other weights than `--model`, whose verified figures
then compared its hits with answers it never gives."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from model_files import reseal

from hopline.cache import evaluate
from hopline.cache.cli import weights_difference
from hopline.cli.main import main
from hopline.model.repository import CachePolicy, ModelRepository

MODEL = "support-intents"


def _clinc(tmp_path: Path) -> Path:
    path = tmp_path / "clinc.json"
    doc = {
        "train": [[f"train {i}", "ab"[i % 2]] for i in range(5)],
        "test": [["test a", "a"], ["test b", "b"]],
        "oos_test": [["elsewhere", "oos"]],
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--concurrency", "0", "argument --concurrency: must be 1 or more, got 0"),
        ("--max-intents", "-1", "argument --max-intents: must be 0 or more, got -1"),
        ("--exact-repeats", "-5", "argument --exact-repeats: must be 0 or more, got -5"),
    ],
)
def test_eval_refuses_counts_that_cannot_work(
    flag: str, value: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cache", "eval", "--clinc", str(tmp_path / "none.json"), "--model", "m"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--model-repo", str(tmp_path / "models"), f"{flag}={value}"])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


def test_load_clinc_refuses_a_negative_intent_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--max-intents must be 0"):
        evaluate.load_clinc(_clinc(tmp_path), -1)


def _fake_pass(outcomes: dict[str, int], calls: list[int]) -> Any:
    """`_pass` without a gateway: these outcomes for the warm-up, the queries untouched."""

    def fake(
        ev: evaluate.Evaluation,
        store: list[str],
        queries: list[evaluate.Query],
        concurrency: int,
        *,
        bypass: bool,
    ) -> tuple[dict[str, int], float, float, set[str]]:
        calls.append(concurrency)
        return dict(outcomes), 0.0, 0.0, set()

    return fake


@pytest.mark.parametrize(
    ("concurrency", "exact_repeats", "said"),
    [
        (0, 500, "--concurrency must be at least 1, got 0"),
        (2, -5, "--exact-repeats must be 0 or more, got -5"),
    ],
)
def test_run_refuses_before_warming(
    concurrency: int, exact_repeats: int, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(evaluate, "_pass", _fake_pass({"miss": 5}, calls))
    with pytest.raises(ValueError, match=said):
        evaluate.run(
            _clinc(tmp_path),
            gateway="127.0.0.1:1",
            cache="127.0.0.1:1",
            model="m",
            policy=CachePolicy(),
            concurrency=concurrency,
            exact_repeats=exact_repeats,
        )
    assert calls == []  # nothing was sent


def test_warmed_counts_the_texts_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two of the five train texts answered: the report says two, not the five it was given.
    monkeypatch.setattr(evaluate, "_pass", _fake_pass({"miss": 1, "exact": 1}, []))
    report = evaluate.run(
        _clinc(tmp_path),
        gateway="127.0.0.1:1",
        cache="127.0.0.1:1",
        model="m",
        policy=CachePolicy(),
        exact_repeats=0,
    )
    assert report["warmed"] == 2
    assert report["warm_outcomes"] == {"miss": 1, "exact": 1}


def test_warm_refuses_no_workers() -> None:
    ev = evaluate.Evaluation("127.0.0.1:1", "127.0.0.1:1", "m", "", "t")
    with pytest.raises(ValueError, match="--concurrency must be at least 1, got 0"):
        asyncio.run(ev.warm(["a"], 0))


def _copy(default_repo: Path, repo: Path, name: str, **changes: Any) -> Path:
    """support-intents/1's config and labels under `name`, with small stand-in files (the
    check compares bytes; nothing here loads them)."""
    source = default_repo / MODEL / "1"
    target = repo / name / "1"
    target.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config["name"] = name
    config["cache"]["mode"] = "semantic"  # else eval notes that only the exact tier answers
    for key, value in changes.items():
        if key == "cache":
            config["cache"] = {**config["cache"], **value}
        elif key != "files":
            config[key] = value
    shutil.copy(source / config["files"]["labels"], target / config["files"]["labels"])
    contents = {"model": b"encoder weights", "tokenizer": b"{}", "head": b"head weights"}
    contents.update(changes.get("files", {}))
    for role, data in contents.items():
        (target / config["files"][role]).write_bytes(data)
    (target / "config.json").write_text(json.dumps(config))
    reseal(target)
    return target


def test_verified_model_with_other_weights_is_refused(
    default_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "models"
    _copy(default_repo, repo, "plain")
    verify = {"verify_target": 0.01}
    _copy(default_repo, repo, "other", cache=verify, files={"head": b"retrained head"})
    argv = ["cache", "eval", "--clinc", str(tmp_path / "none.json"), "--model", "plain"]
    assert main([*argv, "--verified-model", "other", "--model-repo", str(repo)]) == 2
    assert capsys.readouterr().err == (
        "hopline cache eval: error: --verified-model other/1 is not the weights of --model "
        "plain/1: its head file (head.onnx) differs; copy that version under the verified "
        "name (docs/cache.md, Measuring it)\n"
    )
    # A copy of the same files with only its cache policy changed is what the flag is for:
    # past the check, the missing --clinc file is the first thing said.
    _copy(default_repo, repo, "same", cache={**verify, "threshold": 0.8})
    assert main([*argv, "--verified-model", "same", "--model-repo", str(repo)]) == 1
    assert "none.json" in capsys.readouterr().err


def test_weights_difference_names_what_differs(default_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    _copy(default_repo, repo, "plain")
    _copy(default_repo, repo, "model", files={"model": b"other encoder"})
    _copy(default_repo, repo, "oos", oos_threshold=0.123)
    labels = _copy(default_repo, repo, "labels") / "labels.json"
    labels.write_text(json.dumps(json.loads(labels.read_text())[::-1]))  # the columns renamed
    reseal(labels.parent)
    resolve = ModelRepository(repo).resolve
    plain = resolve("plain")
    assert weights_difference(plain, plain) is None
    assert weights_difference(plain, resolve("model")) == "its model file (model.onnx) differs"
    assert weights_difference(plain, resolve("oos")) == ("its oos_threshold is 0.123, not 0.2839")
    assert weights_difference(plain, resolve("labels")) == "its labels differ"


def test_eval_refuses_an_out_it_cannot_write_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--out` naming a file was found only after the whole run, which then ended in 'File
    exists' with no report printed (27 minutes on the full data set)."""
    ran: list[int] = []
    monkeypatch.setattr(evaluate, "run", lambda *a, **k: ran.append(1))
    (tmp_path / "afile").write_text("")
    argv = ["cache", "eval", "--clinc", str(_clinc(tmp_path)), "--model", MODEL]
    assert main([*argv, "--out", str(tmp_path / "afile")]) == 2
    assert f"--out {tmp_path / 'afile'}: is a file" in capsys.readouterr().err
    assert ran == []
