"""`hopline bench`'s flags: a value that cannot work, and a flag nothing in the run would
read, were refused once the bench had started (exit 1: `--baseline foo`, `--metrics bad`),
after every measurement window (`--compute-batches x`: a traceback), or ignored unsaid
(`--idle-ms` without echo_idle, `--metrics mesh=...` with `--target none`, ...). Each is now
a usage error (exit 2, the flags named) before any target runs (a helper's probe)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from hopline.bench import cli as bench_cli
from hopline.cli.main import build_parser, main


def _refused_by_argparse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        # Exit 1, "unknown baseline(s) ['foo']", once the bench had started.
        (
            "--baseline",
            "foo",
            "argument --baseline: unknown baseline 'foo': give some of echo, echo_idle, "
            "inprocess, inprocess_batched, grpc_batched (comma-separated), or none",
        ),
        ("--baseline", "none,echo", "argument --baseline: none goes alone"),
        ("--baseline", "echo,echo", "argument --baseline: names echo more than once"),
        # Exit 1, "--metrics takes TARGET=HOST:PORT...", once the bench had started.
        ("--metrics", "bad", "argument --metrics: takes TARGET=HOST:PORT[,HOST:PORT...]"),
        ("--metrics", "mesh=", "argument --metrics: takes TARGET=HOST:PORT"),
        ("--metrics", "=127.0.0.1:8002", "argument --metrics: takes TARGET=HOST:PORT"),
        # Read at the mesh's window: "cannot read http://127.0.0.1/metrics".
        ("--metrics", "mesh=127.0.0.1", "argument --metrics: takes TARGET=HOST:PORT"),
        ("--metrics", "mesh=127.0.0.1:0", "argument --metrics: takes TARGET=HOST:PORT"),
        # A ValueError's traceback after every measurement window had run.
        ("--compute-batches", "x", "argument --compute-batches: takes comma-separated batch"),
        ("--compute-batches", "0,32", "argument --compute-batches: takes comma-separated batch"),
        ("--compute-batches", "1,1", "argument --compute-batches: names a batch size more"),
        ("--compute-iterations", "-1", "argument --compute-iterations: must be 0 or more"),
        ("--peer", "127.0.0.1:9", "argument --peer: takes NAME=ADDR"),
        ("--peer", "=127.0.0.1:9", "argument --peer: takes NAME=ADDR"),
    ],
)
def test_a_bench_flags_value_that_cannot_work_is_its_usage_error(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in _refused_by_argparse(["bench", flag, value], capsys)


def test_bench_flags_that_work_are_taken() -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "--baseline=none",
            "--metrics=mesh=127.0.0.1:8002,http://[::1]:8021/metrics",
            "--compute-batches=1,8,32",
            "--compute-iterations=0",
            "--peer=ray=127.0.0.1:9",
        ]
    )
    assert (args.baseline, args.compute_batches, args.compute_iterations) == ("none", (1, 8, 32), 0)
    assert args.metrics == ["mesh=127.0.0.1:8002,http://[::1]:8021/metrics"]
    assert args.peer == ["ray=127.0.0.1:9"]


class Measured(Exception):
    """The stand-in for the measurement: the bench got past its checks."""


def _bench(
    monkeypatch: pytest.MonkeyPatch, *flags: str
) -> tuple[int | None, argparse.Namespace | None]:
    """`hopline bench FLAGS`'s exit status (None: it went on to measure), and the flags the
    measurement was given."""
    reached: list[argparse.Namespace] = []

    async def run_targets(args: argparse.Namespace) -> Any:
        reached.append(args)
        raise Measured

    monkeypatch.setattr(bench_cli, "run_targets", run_targets)
    try:
        code: int | None = main(["bench", *flags])
    except Measured:
        code = None
    return code, reached[0] if reached else None


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        # Each was ignored unsaid (or, the first, refused with exit 1 once it had started).
        (
            ["--baseline", "echo_idle", "--rps", "5"],
            "--baseline echo_idle idles each caller between its calls: use --concurrency, "
            "not --rps",
        ),
        (["--baseline", "echo", "--idle-ms", "5"], "--idle-ms goes with --baseline echo_idle"),
        (
            ["--compute-batches", "1", "--compute-iterations", "5"],
            "--compute-batches and --compute-iterations go with --models naming two or more",
        ),
        (
            ["--models", "m:1", "--compute-iterations", "5"],
            "--compute-iterations goes with --models naming two or more",
        ),
        (["--clinc", "data_full.json"], "--clinc goes with --mix clinc, not --mix miss"),
        (
            ["--mix", "clinc", "--clinc", "/nonexistent/d.json"],
            "--clinc /nonexistent/d.json: no such file",
        ),
        (["--metrics", "mesh=127.0.0.1:8002"], "--metrics mesh: no such target in this run"),
        (["--metrics", "ray=127.0.0.1:8002"], "--metrics ray: no such target in this run"),
        (
            ["--peer", "a=127.0.0.1:9", "--peer", "a=127.0.0.1:10"],
            "--peer a given more than once",
        ),
        (["--api-key", "k"], "--api-key is for the mesh's requests: not with --target none"),
        (["--tenant", "t"], "--tenant is for the mesh's and peers' requests: none is measured"),
    ],
)
def test_bench_flags_nothing_would_read_are_refused_before_any_window(
    flags: list[str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, reached = _bench(monkeypatch, "--target", "none", "--baseline", "echo", *flags)
    assert (code, reached) == (2, None)
    assert f"hopline bench: error: {said}" in capsys.readouterr().err


def test_bench_flags_left_out_take_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reached = _bench(monkeypatch, "--target", "none", "--baseline", "echo_idle")
    assert reached is not None
    assert (reached.idle_ms, reached.compute_batches, reached.compute_iterations) == (
        10.0,
        (1, 32),
        200,
    )
    _, reached = _bench(
        monkeypatch,
        *("--target", "none", "--baseline", "echo_idle", "--idle-ms", "0"),
        *("--models", "m:1,m:2", "--compute-batches", "4", "--metrics", "p=127.0.0.1:1"),
        *("--peer", "p=127.0.0.1:9"),
    )
    assert reached is not None
    assert (reached.idle_ms, reached.compute_batches, reached.compute_iterations) == (0, (4,), 200)


def test_bench_once_refuses_what_the_command_refuses() -> None:
    with pytest.raises(SystemExit, match="--idle-ms goes with --baseline echo_idle"):
        bench_cli.bench_once("--target", "none", "--baseline", "echo", "--idle-ms", "5")
