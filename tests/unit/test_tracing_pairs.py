"""bench/tracing.py: exporting's cost is read round by round, each exporting window against
the off window of its own round, and the median taken over rounds."""

from __future__ import annotations

import itertools

import pytest

from hopline.bench.load import Run
from hopline.bench.report import window_figures
from hopline.bench.tracing import (
    Sampling,
    losses,
    p50_added,
    p50_added_less_compute,
    p50_differences,
    pair_order,
    standard_error,
    throughput_loss,
    tracing_targets,
    undecided,
)


def target(rps: list[float], p50: list[float]) -> dict[str, object]:
    return {"rounds": [{"throughput_rps": r, "p50_ms": p} for r, p in zip(rps, p50, strict=True)]}


def arrived(**figures: object) -> dict[str, object]:
    """A scenario's results for one concurrency whose spans reached Jaeger and the collector."""
    return {"exported": True, "discarded": True, **figures}


def test_a_slow_window_on_one_side_is_not_read_as_exporting_s_cost() -> None:
    # The third round's exporting window ran while the machine was slow (300 rps): each
    # round's pair says 1%, 1% and 25%; the windows pooled (equal lengths) say 9.1%.
    off = target([400.0, 380.0, 400.0], [5.0, 5.2, 5.0])
    on = target([396.0, 376.2, 300.0], [5.1, 5.3, 9.0])
    assert throughput_loss(off, on) == pytest.approx(0.01)
    assert p50_added(off, on) == pytest.approx(0.1)
    pooled = throughput_loss(target([1180.0 / 3], [5.0]), target([1072.2 / 3], [5.3]))
    assert pooled == pytest.approx(0.0914, abs=1e-3)


def test_a_mesh_s_two_windows_of_a_round_are_adjacent_and_alternate_in_order() -> None:
    """Off then exporting, exporting then off: a round's pair is back to back, and a switch
    of the sampling share is needed once a round, not twice."""
    off, on = Sampling.OFF, Sampling.ON
    order = pair_order(3)
    assert order == [off, on, on, off, off, on]
    assert sum(a is not b for a, b in itertools.pairwise(order)) == 3


def test_a_gain_is_a_negative_cost() -> None:
    off = target([400.0], [5.0])
    on = target([420.0], [4.8])
    assert throughput_loss(off, on) == pytest.approx(-0.05)
    assert p50_added(off, on) == pytest.approx(-0.2)


def test_windows_from_different_rounds_are_never_paired() -> None:
    with pytest.raises(ValueError, match="shorter"):
        throughput_loss(target([400.0, 400.0], [5.0, 5.0]), target([400.0], [5.0]))


def test_each_requests_own_compute_is_taken_out_beside_the_target_figure() -> None:
    """Two meshes are two processes: a model that computes 0.3 ms slower in the exporting
    mesh's process reads as exporting's cost in the p50s, and not once each request's own
    compute is taken out. Answered requests pair with the replies in order; a failed one
    has no reply and is skipped."""
    compute = {b"a": 3.0, b"b": 3.3}

    def describe(reply: bytes) -> tuple[str | None, dict[str, float]]:
        return "miss", {"inference.compute": compute[reply[:1]]}

    def window(latencies_ms: list[float], reply: bytes) -> dict[str, float]:
        run = Run(
            latencies_ns=[int(ms * 1e6) for ms in latencies_ms] + [50_000_000],
            statuses=["OK"] * len(latencies_ms) + ["UNAVAILABLE"],
            responses=[reply] * len(latencies_ms),
            duration_s=1.0,
            loadgen_cpu_s=0.0,
            machine_busy=0.0,
        )
        return window_figures(run, describe)

    off = {"rounds": [window([5.0, 5.1, 5.2], b"a"), window([5.0, 5.2, 5.4], b"a")]}
    on = {"rounds": [window([5.3, 5.4, 5.5], b"b"), window([5.4, 5.5, 5.6], b"b")]}
    assert p50_added(off, on) == pytest.approx(0.3)
    assert p50_added_less_compute(off, on) == pytest.approx(0.0)
    assert off["rounds"][0]["p50_less_compute_ms"] == pytest.approx(2.1)
    # Replies without the model's timing (echo, an exact hit): no such figure, no pairing.
    assert "p50_less_compute_ms" not in window_figures(
        Run([1_000_000], ["OK"], [b"x"], 1.0, 0.0, 0.0), lambda _: (None, {})
    )
    assert p50_added_less_compute(target([400.0], [5.0]), target([400.0], [5.3])) is None


def test_the_target_row_says_the_figure_without_compute_beside_its_own() -> None:
    sc = {
        "tracing_miss_c1": arrived(
            ratios={"colocated p50_added_ms": 0.45},
            less_compute={"colocated p50_added_ms": 0.05},
        )
    }
    (row,) = tracing_targets(sc)
    assert row["value"] == pytest.approx(0.45)
    assert row["met"] is False  # the target is the plain p50's
    assert "+0.050 ms with each request's own model compute taken out" in row["how"]


def test_the_figure_s_standard_error_is_that_of_its_rounds_differences() -> None:
    # Differences 0.1, 0.3, 0.5 ms: standard deviation 0.2, standard error 0.2 / sqrt(3).
    off = target([400.0, 400.0, 400.0], [5.0, 5.0, 5.0])
    on = target([396.0, 392.0, 388.0], [5.1, 5.3, 5.5])
    assert p50_differences(off, on) == pytest.approx([0.1, 0.3, 0.5])
    assert standard_error(p50_differences(off, on)) == pytest.approx(0.2 / 3**0.5)
    # Losses 1%, 2%, 3%.
    assert losses(off, on) == pytest.approx([0.01, 0.02, 0.03])
    assert standard_error(losses(off, on)) == pytest.approx(0.01 / 3**0.5)
    # Every round read alike: no spread at all; one round: nothing to say.
    assert standard_error(p50_differences(off, off)) == 0.0
    assert standard_error([1.0]) is None


def test_the_row_says_how_many_rounds_and_how_far_chance_could_move_it() -> None:
    sc = {
        "tracing_miss_c1": arrived(
            ratios={"five-process p50_added_ms": 0.25},
            standard_error={"five-process p50_added_ms": 0.081},
            rounds_paired=10,
        ),
        "tracing_miss_c32": arrived(
            ratios={"five-process throughput_loss": 0.02},
            standard_error={"five-process throughput_loss": 0.004},
            rounds_paired=5,
        ),
    }
    c1, c32 = tracing_targets(sc)
    assert c1["met"]
    assert c32["met"]
    assert "median of 10 rounds, standard error 0.081 ms" in c1["how"]
    assert "median of 5 rounds, standard error 0.004" in c32["how"]


def test_a_row_whose_limit_is_within_two_standard_errors_says_it_is_undecided() -> None:
    """Stop 90's five-process row to the discarding collector: 13.5% lost, standard error
    6.3%, against 5%: not met, and not decided either (1.35 errors from the limit)."""
    assert undecided(0.135, 0.05, 0.063)
    assert not undecided(0.017, 0.05, 0.004)  # 8 errors below: decided, met
    assert not undecided(0.20, 0.05, 0.05)  # 3 errors above: decided, not met
    sc = {
        "tracing_miss_c32": arrived(
            ratios={
                "five-process throughput_loss, discarding collector": 0.135,
                "colocated throughput_loss": 0.005,
            },
            standard_error={
                "five-process throughput_loss, discarding collector": 0.063,
                "colocated throughput_loss": 0.009,
            },
            rounds_paired=5,
        ),
    }
    five, colocated = tracing_targets(sc)
    assert not five["met"]  # the target's own test is unchanged
    assert "within 2 standard errors: undecided" in five["how"]
    assert colocated["met"]
    assert "undecided" not in colocated["how"]
