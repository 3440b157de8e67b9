"""How `make bench` reports ghz beside `hopline bench` (bench/ghz.py): each side by its median
round, every round's p50 kept, errors of all rounds counted."""

from __future__ import annotations

from typing import Any

import pytest

from hopline.bench.ghz import median_round


def window(p50: float, errors: int = 0) -> dict[str, Any]:
    return {"p50_ms": p50, "p99_ms": p50 * 3, "requests": 100, "errors": errors}


def test_the_median_round_stands_for_its_side_with_every_p50_beside_it() -> None:
    rounds = [window(1.52), window(1.01, errors=1), window(1.19)]
    chosen = median_round(rounds)
    assert chosen["p50_ms"] == 1.19
    assert chosen["p99_ms"] == pytest.approx(3.57)  # the same round's, not a mix of rounds
    assert chosen["rounds_p50_ms"] == [1.52, 1.01, 1.19]
    assert chosen["errors"] == 1


def test_an_even_count_takes_the_lower_middle_round() -> None:
    assert median_round([window(4.0), window(1.0), window(3.0), window(2.0)])["p50_ms"] == 2.0


def test_no_rounds_is_an_error() -> None:
    with pytest.raises(ValueError, match="no rounds"):
        median_round([])
