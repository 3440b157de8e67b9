"""argparse types for the `hopline` command's numbers: a value that cannot work is argparse's
own error line (the flag named, exit 2) before anything starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above 0, else argparse's own error line."""

    def parse(raw: str) -> float:
        value = kind(raw)
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be above 0, got {raw}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def at_least_zero(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {raw}")
    return value
