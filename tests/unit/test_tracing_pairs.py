"""bench/tracing.py: exporting's cost is read round by round, each exporting window against
the off window of its own round, and the median taken over rounds."""

from __future__ import annotations

import pytest

from hopline.bench.tracing import p50_added, throughput_loss


def target(rps: list[float], p50: list[float]) -> dict[str, object]:
    return {"rounds": [{"throughput_rps": r, "p50_ms": p} for r, p in zip(rps, p50, strict=True)]}


def test_a_slow_window_on_one_side_is_not_read_as_exporting_s_cost() -> None:
    # The third round's exporting window ran while the machine was slow (300 rps): each
    # round's pair says 1%, 1% and 25%; the windows pooled (equal lengths) say 9.1%.
    off = target([400.0, 380.0, 400.0], [5.0, 5.2, 5.0])
    on = target([396.0, 376.2, 300.0], [5.1, 5.3, 9.0])
    assert throughput_loss(off, on) == pytest.approx(0.01)
    assert p50_added(off, on) == pytest.approx(0.1)
    pooled = throughput_loss(target([1180.0 / 3], [5.0]), target([1072.2 / 3], [5.3]))
    assert pooled == pytest.approx(0.0914, abs=1e-3)


def test_a_gain_is_a_negative_cost() -> None:
    off = target([400.0], [5.0])
    on = target([420.0], [4.8])
    assert throughput_loss(off, on) == pytest.approx(-0.05)
    assert p50_added(off, on) == pytest.approx(-0.2)


def test_windows_from_different_rounds_are_never_paired() -> None:
    with pytest.raises(ValueError, match="shorter"):
        throughput_loss(target([400.0, 400.0], [5.0, 5.0]), target([400.0], [5.0]))
