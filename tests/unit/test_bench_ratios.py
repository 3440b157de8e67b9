"""bench/report.py:ratios: the comparisons the performance targets are written against."""

from __future__ import annotations

from typing import Any

import pytest

from hopline.bench.report import ratios


def _target(p50: float, p99: float, rps: float) -> dict[str, Any]:
    return {"p50_ms": p50, "p99_ms": p99, "throughput_rps": rps}


def test_latency_under_the_same_load_against_the_in_process_batcher() -> None:
    """Open loop: both served the same arrivals, so the latencies are what differs."""
    got = ratios(
        {"inprocess_batched": _target(20.0, 60.0, 100.0), "mesh": _target(65.0, 180.0, 99.0)}
    )
    assert got == pytest.approx(
        {
            "mesh_throughput_over_inprocess_batched": 0.99,
            "mesh_p50_over_inprocess_batched_p50": 3.25,
            "mesh_p99_over_inprocess_batched_p99": 3.0,
            "mesh_p99_over_p50": 180 / 65,
        }
    )


def test_ratios_need_both_sides() -> None:
    assert ratios({"inprocess_batched": _target(20.0, 60.0, 100.0)}) == {}
    only_mesh = ratios({"mesh": _target(10.0, 30.0, 50.0)})
    assert only_mesh == pytest.approx({"mesh_p99_over_p50": 3.0})
