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


BUILD = ["model", "build", "--default"]
INT8 = [*BUILD, "--precision", "int8"]
PAIRS = ["cache", "pairs", "--train", "t.jsonl", "--out", "p"]
CALIBRATE = ["cache", "calibrate", "--pairs", "p"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([*BUILD, "--version", "0"], "argument --version: must be a positive integer"),
        ([*BUILD, "--version", "01"], "without leading zeros, got '01'"),
        ([*BUILD, "--oos-threshold", "2"], "--oos-threshold: must be from 0 to 1 (a score)"),
        ([*BUILD, "--reject-rate", "1"], "--reject-rate: must be from 0 up to (not including)"),
        ([*BUILD, "--cache-threshold", "0"], "--cache-threshold: must be above 0 and at most 1"),
        ([*BUILD, "--cache-min-score", "-1"], "--cache-min-score: must be from 0 to 1"),
        ([*BUILD, "--providers", "gpu"], "--providers: unknown execution provider 'gpu'"),
        # The precision check's limits: an agreement of 2 or a cosine of 1.5 refused every
        # converted build after its minutes of work, a negative accuracy drop asked it to beat
        # FP32, and a negative agreement checked nothing.
        ([*INT8, "--min-label-agreement=1.5"], "must be from 0 to 1 (a share of texts)"),
        ([*INT8, "--min-label-agreement=-0.1"], "must be from 0 to 1 (a share of texts)"),
        ([*INT8, "--max-accuracy-drop=-0.01"], "must be from 0 to 1 (a share of texts)"),
        ([*INT8, "--max-accuracy-drop=5"], "--max-accuracy-drop: must be from 0 to 1"),
        ([*INT8, "--min-cosine=1.01"], "--min-cosine: must be a cosine, from -1 to 1, got 1.01"),
        ([*INT8, "--min-cosine-mean=-2"], "--min-cosine-mean: must be a cosine, from -1 to 1"),
        ([*PAIRS, "--holdout", "0"], "--holdout: must be above 0 and below 1, got 0"),
        ([*PAIRS, "--holdout", "1"], "--holdout: must be above 0 and below 1, got 1"),
        ([*CALIBRATE, "--target-false-hit-rate", "1"], "rate: must be above 0 and below 1"),
        ([*CALIBRATE, "--confidence", "1"], "--confidence: must be from 0 up to (not including)"),
    ],
)
def test_a_range_checked_once_the_command_ran_is_its_flags_usage_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was argparse's to let through, then refused with exit 1 by the command (`model
    build --version 0`, `cache pairs --holdout 0`: an operator's probe)."""
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(argv)
    assert ended.value.code == 2
    assert said in capsys.readouterr().err


def test_the_ends_of_each_range_keep_their_meaning() -> None:
    parse = build_parser().parse_args
    ends = ["--reject-rate", "0", "--cache-threshold", "1", "--cache-min-score", "1"]
    build = parse(
        ["model", "build", "--default", "--version", "12", *ends, "--providers", "cuda,cpu"]
    )
    assert (build.version, build.reject_rate, build.cache_threshold) == ("12", 0.0, 1.0)
    assert (build.cache_min_score, build.providers) == (1.0, "cuda,cpu")
    assert parse(["model", "build", "--default", "--oos-threshold", "0"]).oos_threshold == 0.0
    limits = ["--min-label-agreement=1", "--max-accuracy-drop=0", "--min-cosine=-1"]
    check = parse([*INT8, *limits, "--min-cosine-mean=1"])
    assert (check.min_label_agreement, check.max_accuracy_drop) == (1.0, 0.0)
    assert (check.min_cosine, check.min_cosine_mean) == (-1.0, 1.0)
    cal = parse(["cache", "calibrate", "--pairs", "p", "--confidence", "0"])
    assert (cal.confidence, cal.target_false_hit_rate) == (0.0, 0.01)
    pairs = ["cache", "pairs", "--train", "t", "--out", "p"]
    assert parse([*pairs, "--holdout", "0.25"]).holdout == 0.25


def test_certificate_days_of_none_are_refused_by_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--days 0` ran openssl, which refused it: a RuntimeError's traceback."""
    from hopline.cli import certs

    def made(*args: object) -> Path:
        raise AssertionError("certificates made for --days 0")

    monkeypatch.setattr(certs, "make_certs", made)
    with pytest.raises(SystemExit) as ended:
        certs.main(["folder", "--days", "0"])
    assert ended.value.code == 2
    assert "argument --days: must be above 0, got 0" in capsys.readouterr().err


def _build_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, str, dict[str, object]]:
    """`hopline model build FLAGS`'s exit status and stderr's last line, with the build
    itself stood in for: it records what it was asked and stops there (exit 1)."""
    from hopline.model import build

    asked: dict[str, object] = {}

    def stand_in(*args: object, **kwargs: object) -> Path:
        asked.update(kwargs)
        raise ValueError("built")

    monkeypatch.setattr(build, "build_model", stand_in)
    code = cli_main.main(["model", "build", "--repo", "nowhere", *flags])
    return code, capsys.readouterr().err.strip().splitlines()[-1], asked


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        # The bundled set is JSON Lines, no object of splits: the whole set was built.
        (("--default", "--split", "test"), "--split goes with --train (a JSON object of splits)"),
        # The threshold given was used as it was, the rate read by nothing.
        (
            ("--default", "--oos-threshold", "0.5", "--reject-rate", "0.1"),
            "--reject-rate calibrates the threshold that --oos-threshold fixes",
        ),
        # An fp32 build converts nothing, so checks nothing.
        (("--default", "--min-cosine", "0.9"), "--min-cosine is for an int8 or fp16 build"),
    ],
)
def test_a_build_flag_read_by_nothing_beside_another_is_a_usage_error(
    flags: tuple[str, ...],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, last, asked = _build_refused(monkeypatch, capsys, *flags)
    assert (code, asked) == (2, {})
    assert last.startswith("hopline model build: error: "), last
    assert said in last, last


def test_a_build_without_reject_rate_calibrates_at_the_default_rate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, last, asked = _build_refused(monkeypatch, capsys, "--default")
    assert (code, last) == (1, "hopline model build: built")
    assert asked["in_scope_reject_rate"] == 0.02
    assert asked["oos_threshold"] is None


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--since", "5m"], "--since goes"),
        (["--limit", "3"], "--limit goes"),
        (["--service", "gateway"], "--service goes"),
        (["--since", "5m", "--limit", "3"], "--since and --limit go"),
    ],
)
def test_jaeger_flags_with_a_file_are_a_usage_error(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--file spans.json --since 5m` reported on every trace of the file, exit 0."""
    assert cli_main.main(["trace", "report", "--file", str(tmp_path / "spans.json"), *flags]) == 2
    assert capsys.readouterr().err == (
        f"hopline trace report: error: {named} with --jaeger, not --file (the whole file is read)\n"
    )


def test_jaeger_is_asked_for_the_last_ten_minutes_of_the_gateways_traces_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from conftest import otlp_request
    from hopline.observability import report

    asked: list[tuple[object, ...]] = []

    def fetch_jaeger(*args: object) -> list[object]:
        asked.append(args)
        return [otlp_request("ab" * 16)]

    monkeypatch.setattr(report, "fetch_jaeger", fetch_jaeger)
    assert cli_main.main(["trace", "report", "--jaeger", "http://jaeger:16686"]) == 0
    assert asked == [
        ("http://jaeger:16686", "gateway", 600.0, 2000, "hopline.gateway.v1.GatewayService/Predict")
    ]


def test_cache_stats_json_prints_counts_as_numbers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """protobuf's JSON mapping wrote every int64 count as a string ("entries": "3")."""
    import contextlib

    from hopline.cache import stats_cli
    from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
    from hopline.runtime import tls

    reply = cache_pb2.GetStatsResponse(entries=3, lookups=2**40, lookup_p99_ms=1.5, uri="a.db")
    reply.verify_rules.add(threshold=0.5, observations=7).scope.tenant = "acme"

    class Stub:
        def __init__(self, channel: object) -> None:
            pass

        def GetStats(self, request: object, timeout: float) -> cache_pb2.GetStatsResponse:
            return reply

    monkeypatch.setattr(tls, "channel", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(cache_pb2_grpc, "CacheServiceStub", Stub)
    args = argparse.Namespace(cache="127.0.0.1:1", json=True)
    assert stats_cli.show_stats(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["entries"], doc["lookups"], doc["store_errors"]) == (3, 2**40, 0)
    assert (doc["lookup_p99_ms"], doc["uri"], doc["milvus_unreachable"]) == (1.5, "a.db", False)
    (rule,) = doc["verify_rules"]
    assert (rule["observations"], rule["held_back"], rule["threshold"]) == (7, 0, 0.5)
    assert rule["scope"]["tenant"] == "acme"


# Line-buffered, each line is written as it is printed (the command's own write fails);
# block-buffered, the report is written once the command returned.
@pytest.mark.parametrize("buffering", [1, -1])
def test_a_reader_gone_from_the_pipe_ends_the_command_quietly(
    buffering: int,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`hopline trace report | head -1` printed "error: [Errno 32] Broken pipe" (trace's and
    cache's handlers took it for a file's error), or "Exception ignored ... BrokenPipeError"
    at the interpreter's exit."""
    import os

    from conftest import otlp_request

    spans = tmp_path / "spans.jsonl"
    spans.write_text("\n".join(json.dumps(otlp_request(f"{i:032x}")) for i in range(1, 300)))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    with os.fdopen(write, "w", buffering=buffering) as out:
        monkeypatch.setattr("sys.stdout", out)
        assert cli_main.main(["trace", "report", "--file", str(spans)]) == 141  # 128 + SIGPIPE
        # What is left to write at exit goes to devnull, not to a pipe that fails again.
        assert os.path.samestat(os.fstat(out.fileno()), os.stat(os.devnull))
    assert capsys.readouterr().err == ""


def test_a_cache_command_leaves_a_broken_pipe_to_hopline_main() -> None:
    def handler(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    args = argparse.Namespace(cache_command="stats", cache_handler=handler, model_repo="models")
    with pytest.raises(BrokenPipeError):
        cache_cli.run_cache_command(args)
