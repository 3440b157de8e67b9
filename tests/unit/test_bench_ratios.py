"""bench/report.py: the comparisons the performance targets are written against, and what a
window's figures are of."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from hopline.bench.load import Run
from hopline.bench.report import ratios, summarise, window_figures
from hopline.bench.suite_report import (
    front_door_echoes,
    front_door_share,
    model_run_share,
    peer_judgement,
)


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


def test_the_c1_row_says_how_many_echoes_the_front_door_takes() -> None:
    targets = {
        "echo": {"p50_ms": 0.5},
        "inprocess": {"p50_ms": 8.0},
        "grpc_batched": {"p50_ms": 9.75},
    }
    assert front_door_echoes(targets) == (
        "a bare gRPC server over the same batcher p50 9.75 ms, 3.5 echoes up"
    )
    targets["inprocess_batched"] = {"p50_ms": 8.25}
    assert front_door_echoes(targets) == (
        "a bare gRPC server over the same batcher p50 9.75 ms, 3.5 echoes up, "
        "the batcher alone p50 8.25 ms, 0.5 up"
    )
    del targets["grpc_batched"]
    assert front_door_echoes(targets) == "no grpc_batched run"


def test_the_c1_row_says_how_much_slower_the_model_ran_in_the_mesh() -> None:
    """The model's run p50 in the mesh against the same run's in process, both from the
    replies' `inference.compute`; a record without it (a run before the in-process target
    timed its runs) says so rather than reading as no difference."""
    targets: dict[str, Any] = {
        "inprocess": {"hops_ms": {"inference.compute": {"p50": 3.0, "p99": 4.0}}},
        "mesh": {"hops_ms": {"inference.compute": {"p50": 3.6, "p99": 9.0}}},
    }
    assert model_run_share(targets, "mesh") == (
        "the model's run p50 3.60 ms against 3.00 in process (+0.60)"
    )
    targets["inprocess"] = {"hops_ms": {}}
    assert model_run_share(targets, "mesh") == "no model run timed"


def _answered(p99: float, rps: float, errors: int) -> dict[str, Any]:
    return {"p50_ms": p99 / 3, "p99_ms": p99, "throughput_rps": rps, "errors": errors}


def test_against_a_peer_errors_count_and_a_failing_peer_loses_on_latency() -> None:
    """Figures are of answered requests (bench/report.py:summarise): a peer that timed some
    out has a p99 without them, so its errors, not its p99, decide latency; the mesh's own
    errors fail the row whatever its figures."""
    mesh = _answered(p99=100.0, rps=300.0, errors=0)
    assert peer_judgement(mesh, _answered(p99=400.0, rps=80.0, errors=0))[1]
    assert not peer_judgement(mesh, _answered(p99=90.0, rps=80.0, errors=0))[1]
    assert peer_judgement(mesh, _answered(p99=90.0, rps=80.0, errors=1304))[1]
    assert peer_judgement(mesh, _answered(p99=float("nan"), rps=0.0, errors=2122))[1]
    assert not peer_judgement(mesh, _answered(p99=90.0, rps=310.0, errors=5))[1]  # more rps
    assert not peer_judgement(_answered(p99=100.0, rps=300.0, errors=1), _answered(
        p99=400.0, rps=80.0, errors=0))[1]  # fmt: skip
    ratio, _, how = peer_judgement(mesh, _answered(p99=400.0, rps=75.0, errors=3))
    assert ratio == pytest.approx(4.0)
    assert "errors 0 vs 3" in how


def test_a_windows_figures_are_of_the_requests_answered() -> None:
    """A refusal is fast: 1,000 refused calls at 0.05 ms beside 100 answers at 10 ms must
    read as 100 requests at 10 ms and 1,000 errors, not 1,100 requests at 0.05 ms."""
    refused, answered = ["UNAVAILABLE"] * 1000, ["OK"] * 100
    run = Run(
        latencies_ns=[50_000] * 1000 + [10_000_000] * 100,
        statuses=refused + answered,
        responses=[b""] * 100,
        duration_s=2.0,
        loadgen_cpu_s=0.2,
        machine_busy=0.5,
    )
    record = summarise(run, lambda _: (None, {}))
    assert record["requests"] == 100
    assert record["throughput_rps"] == pytest.approx(50.0)
    assert record["p50_ms"] == pytest.approx(10.0, rel=1e-3)
    assert record["mean_ms"] == pytest.approx(10.0)
    assert (record["errors"], record["errors_by_status"]) == (1000, {"UNAVAILABLE": 1000})
    assert record["cpu_ms_per_request"]["load_generator"] == pytest.approx(2.0)
    assert window_figures(run) == pytest.approx(
        {"throughput_rps": 50.0, "p50_ms": 10.0, "p99_ms": 10.0}, rel=1e-3
    )
    nothing = dataclasses.replace(
        run, latencies_ns=[50_000] * 10, statuses=refused[:10], responses=[]
    )
    none_answered = summarise(nothing, lambda _: (None, {}))
    assert (none_answered["requests"], none_answered["throughput_rps"]) == (0, 0.0)
    assert math.isnan(none_answered["p50_ms"])
