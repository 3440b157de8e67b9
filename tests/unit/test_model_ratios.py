"""bench/report.py:model_ratios: `hopline bench --models A,B` figures of B against A, the
mesh's saving set beside what the model saved inside the same requests."""

from __future__ import annotations

from typing import Any

import pytest

from hopline.bench.report import model_ratios


def _target(p50: float, rps: float, compute_p50: float | None = None) -> dict[str, Any]:
    target: dict[str, Any] = {"p50_ms": p50, "throughput_rps": rps}
    if compute_p50 is not None:
        target["hops_ms"] = {"inference.compute": {"p50": compute_p50, "p99": 2 * compute_p50}}
    return target


def test_second_model_against_the_first_per_target() -> None:
    targets = {
        "echo": _target(0.7, 1300.0),  # no model: no ratio
        "inprocess@m:1": _target(8.0, 120.0),
        "inprocess@m:2": _target(6.0, 160.0),
        "mesh@m:1": _target(19.0, 50.0, compute_p50=8.1),
        "mesh@m:2": _target(16.5, 58.0, compute_p50=5.5),
    }
    ratios = model_ratios(targets)
    assert ratios == pytest.approx(
        {
            "inprocess@m:2_p50_over_first_model": 0.75,
            "inprocess@m:2_p50_saving_ms": 2.0,
            "inprocess@m:2_throughput_over_first_model": 160 / 120,
            "mesh@m:2_p50_over_first_model": 16.5 / 19.0,
            "mesh@m:2_p50_saving_ms": 2.5,
            "mesh@m:2_throughput_over_first_model": 58 / 50,
            # The in-process target's replies carry no hop timings: no such figure for it.
            "mesh@m:2_inference_compute_saving_ms": 8.1 - 5.5,
        }
    )


def test_compute_alone_speedups_and_savings() -> None:
    compute = {
        "models": {
            "m/1 (fp32)": {"batch_1": {"p50_ms": 8.0, "speedup_over_first": 1.0}},
            "m/2 (int8)": {"batch_1": {"p50_ms": 5.0, "speedup_over_first": 1.6}},
        }
    }
    assert model_ratios({}, compute) == pytest.approx(
        {
            "compute m/2 (int8) batch_1 speedup": 1.6,
            "compute m/2 (int8) batch_1 saving_ms": 5.0 * 1.6 - 5.0,
        }
    )
