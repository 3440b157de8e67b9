"""The `hopline` command's numeric flags (cli/arg_types.py): a count or a time that cannot work
is argparse's error (exit 2, the flag named) before anything starts, as is a string argument
that is not UTF-8 or a top-k past protobuf's int32 (both were tracebacks). Before, `hopline bench
--rps -5` ended in numpy's traceback, `--concurrency 0` and `--rounds 0` ran as 1,
`--duration 0` reported NaNs, and `hopline predict --timeout 0` sent no deadline at all."""

from __future__ import annotations

import pytest

from hopline.cli.main import build_parser


@pytest.mark.parametrize(
    ("command", "flag", "value", "said"),
    [
        ("predict", "--timeout", "0", "must be above 0"),
        ("predict", "--timeout", "-1", "must be above 0"),
        ("predict", "--top-k", "99999999999", "must be 0 to 2147483647"),
        ("predict", "--top-k", "-1", "must be 0 to 2147483647"),
        ("predict", "--top-k", "x", "invalid int value"),
        ("predict", "--tenant", "\udcff", "is not valid UTF-8 (b'\\xff' at character 0)"),
        ("predict", "--model", "m\udcfe", "is not valid UTF-8 (b'\\xfe' at character 1)"),
        ("bench", "--concurrency", "0", "must be above 0"),
        ("bench", "--concurrency", "-3", "must be above 0"),
        ("bench", "--concurrency", "x", "invalid int value"),
        ("bench", "--rps", "-5", "must be above 0"),
        ("bench", "--rps", "nan", "must be above 0"),
        ("bench", "--duration", "0", "must be above 0"),
        ("bench", "--timeout", "0", "must be above 0"),
        ("bench", "--rounds", "0", "must be above 0"),
        ("bench", "--connections", "0", "must be above 0"),
        ("bench", "--warmup", "-1", "must be 0 or more"),
        ("bench", "--idle-ms", "-0.5", "must be 0 or more"),
        # inf: a prediction that failed at once DEADLINE_EXCEEDED, a bench's traceback.
        ("predict", "--timeout", "inf", "must be a finite number"),
        ("bench", "--duration", "inf", "must be a finite number"),
        ("bench", "--warmup", "1e400", "must be a finite number"),
    ],
)
def test_a_value_that_cannot_work_is_refused(
    command: str, flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = ["predict", "a text"] if command == "predict" else [command]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*before, flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {said}" in capsys.readouterr().err


def test_values_that_work_are_taken_as_numbers() -> None:
    args = build_parser().parse_args(
        ["bench", "--rps", "2.5", "--duration", "1", "--warmup", "0", "--rounds", "3"]
    )
    assert (args.rps, args.duration, args.warmup, args.rounds) == (2.5, 1.0, 0.0, 3)
    assert isinstance(args.rounds, int)
    assert build_parser().parse_args(["bench", "--concurrency", "32"]).concurrency == 32


def test_a_text_the_locale_could_not_decode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 reach argv as lone surrogates (`surrogateescape`); building
    the request from them ended in protobuf's UnicodeEncodeError traceback."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["predict", "pass\udcff\udcfeword"])
    assert exit_.value.code == 2
    assert "argument text: is not valid UTF-8 (b'\\xff\\xfe' at character 4)" in (
        capsys.readouterr().err
    )
    assert build_parser().parse_args(["predict", "pässwörd ✓", "--top-k", "0"]).top_k == 0
