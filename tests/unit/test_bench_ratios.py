"""bench/report.py:ratios: the comparisons the performance targets are written against."""

from __future__ import annotations

from typing import Any

import pytest

from hopline.bench.report import ratios
from hopline.bench.suite import front_door_share


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


def test_the_mesh_against_a_bare_grpc_server_over_the_same_batcher() -> None:
    """grpc_batched (bench/front_door.py) is what hopline's own parts are measured above."""
    got = ratios(
        {
            "inprocess_batched": _target(70.0, 130.0, 400.0),
            "grpc_batched": _target(80.0, 150.0, 360.0),
            "mesh": _target(100.0, 200.0, 288.0),
        }
    )
    assert got["mesh_throughput_over_grpc_batched"] == pytest.approx(0.8)
    assert got["mesh_throughput_over_inprocess_batched"] == pytest.approx(0.72)
    assert "mesh_throughput_over_grpc_batched" not in ratios(
        {"inprocess_batched": _target(70.0, 130.0, 400.0), "mesh": _target(1.0, 2.0, 3.0)}
    )


def test_the_c32_row_says_where_the_front_door_stands() -> None:
    targets = {
        "inprocess_batched": _target(70.0, 130.0, 400.0),
        "grpc_batched": _target(80.0, 150.0, 360.0),
        "mesh": _target(100.0, 200.0, 288.0),
    }
    assert front_door_share(targets, "mesh") == (
        "a bare gRPC server over the same batcher 0.900x, this mesh 0.800x of it"
    )
    del targets["grpc_batched"]
    assert front_door_share(targets, "mesh") == "no grpc_batched run"
