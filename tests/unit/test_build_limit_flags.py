"""`hopline model build`'s precision check limits took any finite number: an agreement of 2
or a cosine of 1.5 refused every converted build after its minutes of work, a negative
accuracy drop asked a conversion to beat FP32, and a negative agreement checked nothing. Each
limit now has its range (a share of texts, 0 to 1; a cosine, -1 to 1), refused by argparse."""

from __future__ import annotations

import pytest

from hopline.cli.main import build_parser


def _refused_by_argparse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--min-label-agreement", "1.5", "must be from 0 to 1 (a share of texts), got 1.5"),
        ("--min-label-agreement", "-0.1", "must be from 0 to 1 (a share of texts), got -0.1"),
        # A negative drop asked a conversion to be more accurate than FP32.
        ("--max-accuracy-drop", "-0.01", "must be from 0 to 1 (a share of texts), got -0.01"),
        ("--max-accuracy-drop", "5", "must be from 0 to 1 (a share of texts), got 5"),
        # No cosine is above 1: every converted build was refused after its minutes of work.
        ("--min-cosine", "1.01", "must be a cosine, from -1 to 1, got 1.01"),
        ("--min-cosine-mean", "-2", "must be a cosine, from -1 to 1, got -2"),
    ],
)
def test_a_precision_check_limit_outside_its_range_is_its_usage_error(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["model", "build", "--default", "--precision", "int8", f"{flag}={value}"]
    assert f"argument {flag}: {said}" in _refused_by_argparse(argv, capsys)


def test_the_ends_of_the_precision_check_limits_are_taken() -> None:
    ends = ["--min-label-agreement=1", "--max-accuracy-drop=0", "--min-cosine=-1"]
    args = build_parser().parse_args(
        ["model", "build", "--default", "--precision", "int8", *ends, "--min-cosine-mean=1"]
    )
    assert (args.min_label_agreement, args.max_accuracy_drop) == (1.0, 0.0)
    assert (args.min_cosine, args.min_cosine_mean) == (-1.0, 1.0)
