"""A user's mistake on the `hopline` command line ends in one line naming what to fix and exit
status 2, argparse's, before anything runs. Before, an unknown model or version was
ModelNotFoundError's traceback (`cache pairs`, `cache eval`, `bench`, the latter after the echo's
window), `serve bogus` listed enum reprs, `trace report --since banana` and `cache pairs --clinc`
with a JSONL file named neither the flag nor the file, `model build` alone exited 1, and `bench`
against no gateway measured every baseline, then printed NaN ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hopline.cli.main import build_parser, main

MODEL = "support-intents"


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model repository serving support-intents version 1 (a version is its config.json:
    resolving a missing model or version never reads one)."""
    monkeypatch.delenv("HOPLINE_DEFAULT_MODEL", raising=False)
    version = tmp_path / "models" / MODEL / "1"
    version.mkdir(parents=True)
    (version / "config.json").write_text("{}")
    return tmp_path / "models"


def _train_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    rows = [{"text": f"text number {i}", "label": "ab"[i % 2]} for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("model", "said"),
    [
        (["--model", "nope"], f"unknown model 'nope' (repository has: {MODEL})"),
        (["--model", MODEL, "--model-version", "99"], f"model '{MODEL}' has no version '99'"),
    ],
)
def test_cache_pairs_names_an_unknown_model(
    model: list[str], said: str, repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = str(_train_file(tmp_path))
    argv = ["cache", "pairs", "--train", train, "--out", str(tmp_path / "p.json")]
    assert main([*argv, *model, "--model-repo", str(repo)]) == 2
    assert capsys.readouterr().err == (
        f"hopline cache pairs: error: {said}"
        + (" (has: 1)" if "99" in model else "")
        + f" in --model-repo {repo}\n"
    )


def test_cache_eval_names_an_unknown_model(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cache", "eval", "--clinc", str(tmp_path / "f"), "--model", "nope"]
    assert main([*argv, "--model-repo", str(repo)]) == 2
    assert capsys.readouterr().err == (
        f"hopline cache eval: error: unknown model 'nope' (repository has: {MODEL}) "
        f"in --model-repo {repo}\n"
    )


def _no_baseline_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(*_: object) -> None:
        raise AssertionError("a target was measured")

    monkeypatch.setattr("hopline.bench.cli.measure", measure)
    monkeypatch.setattr("hopline.bench.cli.start_echo", measure)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--model", "nope"], f"unknown model 'nope' (repository has: {MODEL})"),
        (["--models", f"{MODEL}:99"], f"model '{MODEL}' has no version '99' (has: 1)"),
        (["--baseline", "grpc_batched", "--model", "nope"], "unknown model 'nope'"),
    ],
)
def test_bench_names_an_unknown_model_before_any_target_runs(
    argv: list[str],
    said: str,
    repo: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_baseline_runs(monkeypatch)
    assert main(["bench", *argv, "--model-repo", str(repo)]) == 2
    assert capsys.readouterr().err == (
        f"hopline bench: error: {said}"
        + (f" (repository has: {MODEL})" if "grpc_batched" in argv else "")
        + f" in --model-repo {repo}\n"
    )


def test_bench_names_a_model_repository_that_holds_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HOPLINE_DEFAULT_MODEL", raising=False)
    _no_baseline_runs(monkeypatch)
    missing = tmp_path / "nonexistent"
    assert main(["bench", "--target", "none", "--model-repo", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"hopline bench: error: unknown model '{MODEL}' (repository has: none) "
        f"in --model-repo {missing}\n"
    )


def test_bench_stops_before_the_baselines_when_no_gateway_answers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Port 1 refuses at once: the health check fails in a millisecond, not its deadline."""
    monkeypatch.delenv("HOPLINE_TLS_CA", raising=False)
    _no_baseline_runs(monkeypatch)
    argv = ["--target", "127.0.0.1:1", "--baseline", "echo", "--duration", "1", "--warmup", "0"]
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err == (
        "hopline bench: error: no gateway answered at 127.0.0.1:1 over plaintext: `make run` "
        "starts the mesh; --target or HOPLINE_GATEWAY_ADDR names another (--target none "
        "measures only the baselines)\n"
    )


def test_serve_lists_the_services_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "(choose from 'tokenizer', 'postprocess', 'cache', 'inference', 'gateway')" in err
    assert "ServiceName" not in err


@pytest.mark.parametrize("since", ["banana", "5x", "0", "-1m", "nan", "inf", "", "s"])
def test_trace_since_that_is_no_duration_names_the_flag(
    since: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        # `--since=`: argparse takes a separate `-1m` for a flag of its own.
        build_parser().parse_args(["trace", "report", "--jaeger", "http://x", f"--since={since}"])
    assert exit_.value.code == 2
    assert f"argument --since: a duration like 30s, 5m, 1h, got {since!r}" in (
        capsys.readouterr().err
    )


def test_trace_since_is_taken_in_seconds() -> None:
    parse = build_parser().parse_args
    base = ["trace", "report", "--jaeger", "http://x"]
    assert parse(base).since is None  # 10 minutes, the command's (None: refused with --file)
    assert [parse([*base, "--since", s]).since for s in ("30s", "5m", "1h", "90")] == [
        30.0,
        300.0,
        3600.0,
        90.0,
    ]


def test_cache_pairs_names_a_clinc_file_that_is_not_one_json_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clinc = _train_file(tmp_path)  # JSON Lines: what --train takes
    assert main(["cache", "pairs", "--clinc", str(clinc), "--out", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: --clinc {clinc}: expected one JSON object of splits of [text, label] "
        "(as CLINC150's data_full.json): Extra data: line 2"
    )
    assert err.endswith("; JSON Lines of {text,label} go to --train\n")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "give --train FILE --name NAME, or --default"),
        (["--train", "x.jsonl"], "--name is required with --train"),
    ],
)
def test_model_build_without_its_data_is_a_usage_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "build", *argv]) == 2
    assert capsys.readouterr().err == f"hopline model build: error: {said}\n"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"train": [["hi", "greet"]], "val": []}', "it has train, val"),
        ("[1, 2]", "it has a list"),
        ('{"train": [["hi"]], "test": [], "oos_test": []}', "a row not enough values"),
        ("not json", "Expecting value"),
    ],
)
def test_cache_eval_names_the_file_and_its_shape(tmp_path: Path, content: str, said: str) -> None:
    """A file missing a split was a KeyError traceback; a short row or text that is not
    JSON was a message naming neither the file nor the format."""
    from hopline.cache.evaluate import load_clinc

    path = tmp_path / "clinc.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"expected a JSON object of splits") as info:
        load_clinc(path)
    assert str(info.value).startswith(f"--clinc {path}: expected a JSON object of splits")
    assert said in str(info.value)
