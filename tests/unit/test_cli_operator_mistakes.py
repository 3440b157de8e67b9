"""An operator's mistakes and interruptions on the `hopline` command line (an operator's probe
of every subcommand): each ends in one line and the right exit status, with nothing half
done left behind."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from hopline.bench.report import ratios, without_nan
from hopline.cache import cli as cache_cli
from hopline.cache.invalidate_cli import request_of
from hopline.cache.pairs import Pair, write_pairs
from hopline.cache.store import EncoderBuildError
from hopline.cli import main as cli_main
from hopline.cli.main import build_parser


def _invalidate(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["cache", "invalidate", *argv])


def test_an_id_with_a_scope_is_a_usage_error_not_the_whole_scope() -> None:
    """`--id X --tenant T` read as "X, of T" and dropped every entry of T, exit 0 (the RPC
    deletes the ids and the scope)."""
    said = request_of(_invalidate("--id", "ab" * 32, "--tenant", "acme"))
    assert isinstance(said, str)
    assert "give --id alone" in said
    assert not isinstance(request_of(_invalidate("--id", "ab" * 32)), str)
    assert not isinstance(request_of(_invalidate("--tenant", "acme")), str)


@pytest.mark.parametrize("flag", ["--min-cosine", "--cache-threshold", "--reject-rate"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_number_that_is_no_number_is_refused_by_its_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--min-cosine nan` switched the INT8 check off (NaN compares false) and wrote NaN into
    config.json, exit 0."""
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(["model", "build", "--default", f"{flag}={value}"])
    assert ended.value.code == 2
    assert f"argument {flag}: must be a finite number, got {value}" in capsys.readouterr().err


def test_a_calibration_target_that_is_no_number_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["cache", "calibrate", "--pairs", "p.jsonl", "--target-false-hit-rate", "nan"]
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(argv)
    assert ended.value.code == 2
    assert "must be a finite number" in capsys.readouterr().err


def test_a_timeout_past_grpcs_deadline_range_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`predict --timeout 1e10` wrapped past gRPC's int64 nanoseconds: an immediate
    DEADLINE_EXCEEDED."""
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(["predict", "hi", "--timeout", "1e10"])
    assert ended.value.code == 2
    assert "argument --timeout: must be at most 1e+09 s, got 1e10" in capsys.readouterr().err
    assert build_parser().parse_args(["predict", "hi", "--timeout", "1e9"]).timeout == 1e9


def test_a_peer_that_answered_nothing_is_a_nan_ratio_not_a_crash() -> None:
    """An unreachable `--peer` ended the bench in ZeroDivisionError, every result lost."""
    got = ratios(
        {
            "mesh": {"p50_ms": 5.0, "p99_ms": 9.0, "throughput_rps": 200.0},
            "peer_foo": {"p50_ms": math.nan, "p99_ms": math.nan, "throughput_rps": 0.0},
        }
    )
    assert math.isnan(got["mesh_throughput_over_peer_foo"])
    assert math.isnan(got["mesh_p99_over_peer_foo_p99"])
    assert got["mesh_p99_over_p50"] == pytest.approx(1.8)


def test_ctrl_c_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A traceback in every long command (cache pairs, model build, cache eval, bench, trace
    report)."""

    def interrupted(argv: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_main", interrupted)
    assert cli_main.main(["trace", "report"]) == 130
    assert capsys.readouterr().err == "hopline: stopped by Ctrl-C\n"


def test_an_encoder_that_cannot_be_built_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cache pairs --work-dir <read-only>` ended in a chained traceback."""

    def handler(args: argparse.Namespace) -> int:
        raise EncoderBuildError("the embedding encoder is not built yet and cannot be built")

    args = argparse.Namespace(cache_command="pairs", cache_handler=handler, model_repo="models")
    assert cache_cli.run_cache_command(args) == 1
    assert capsys.readouterr().err.startswith("error: the embedding encoder is not built yet")


def test_pairs_are_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """A full disk left 90 lines ending mid-record, over the earlier good file."""
    out = tmp_path / "pairs.jsonl"
    write_pairs([Pair("a", "b", True, "x", "x")], out)
    good = out.read_text()

    def failing() -> Iterator[Pair]:
        yield Pair("c", "d", False, "x", "y")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=f"writing the pairs to {out} failed"):
        write_pairs(failing(), out)
    assert out.read_text() == good
    assert [p.name for p in tmp_path.iterdir()] == ["pairs.jsonl"]
    assert json.loads(good.splitlines()[0])["same"] is True


def test_an_evaluation_of_a_model_that_knows_none_of_the_intents_is_refused_first(
    tmp_path: Path,
) -> None:
    """A model trained on other intents scored 0.00% with and without the cache, exit 0, and
    left its warm-up's entries in the cache: refused before anything is sent (the gateway
    named here answers nothing)."""
    from hopline.cache.evaluate import EVAL_SPLITS, run
    from hopline.model.repository import CachePolicy

    clinc = tmp_path / "data_full.json"
    rows = [["where is my card", "card_arrival"], ["book a flight", "book_flight"]]
    clinc.write_text(json.dumps({split: rows for split in EVAL_SPLITS}))
    with pytest.raises(ValueError, match=r"none of the 2 intents of .* is a label of model"):
        run(
            clinc,
            gateway="127.0.0.1:1",
            cache="127.0.0.1:1",
            model="support-intents",
            policy=CachePolicy(),
            labels=("password_reset", "refund"),
        )


def test_pairs_written_through_a_link_replace_its_target_and_keep_the_link(
    tmp_path: Path,
) -> None:
    """Renamed over the path, a link was replaced by a file and its target left as it was
    (a reviewer's snippet)."""
    target = tmp_path / "real.jsonl"
    target.write_text("old\n")
    link = tmp_path / "pairs.jsonl"
    link.symlink_to(target)
    write_pairs([Pair("a", "b", True, "x", "x")], link)
    assert link.is_symlink()
    assert json.loads(target.read_text())["query"] == "a"


def test_a_ratio_against_nothing_is_written_as_json_null() -> None:
    """A bare NaN is not JSON: jq and JavaScript refused the bench's --json file."""
    doc = {"ratios": {"mesh_throughput_over_peer_foo": math.nan}, "rows": [1.5, math.inf]}
    assert json.loads(json.dumps(without_nan(doc), allow_nan=False)) == {
        "ratios": {"mesh_throughput_over_peer_foo": None},
        "rows": [1.5, None],
    }
