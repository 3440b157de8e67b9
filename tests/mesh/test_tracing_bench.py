"""`make bench`'s tracing scenario: four real meshes, two exporting to a real Jaeger and two
to a real OTLP/gRPC collector that discards what it gets (bench/otlp_sink.py), each measured
sampling none and sampling 10% by the strategy the real Jaeger serves.

Short windows: this is about the scenario's plumbing (the exporting meshes' spans reach
Jaeger and the collector, each ratio comes from the right pair of windows of one mesh, a
target is not met when no span arrived), not about its figures, which come from `make bench`.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from hopline.bench.tracing import (
    DISCARDING_SUFFIX,
    TOPOLOGIES,
    Export,
    Sampling,
    target_name,
    tracing_scenario,
    tracing_targets,
)


def test_tracing_scenario_measures_each_topology_exporting_and_not(
    default_repo: Path, tmp_path: Path
) -> None:
    sc = tracing_scenario(
        default_repo, tmp_path, rounds=2, c1_rounds=3, duration_s=0.6, warmup_s=0.2
    )

    c1, c32 = sc["tracing_miss_c1"], sc["tracing_miss_c32"]
    names = {
        f"peer_{t.value.replace('-', '_')}_{v}"
        for t in TOPOLOGIES
        for v in ("off", "exporting", "discarding_off", "discarding")
    }
    assert {target_name(t, v, s) for t in TOPOLOGIES for v in Export for s in Sampling} == names
    for result, rounds in ((c1, 3), (c32, 2)):
        assert set(result["targets"]) == names
        assert all(t["requests"] > 0 and t["errors"] == 0 for t in result["targets"].values())
        # A window of each target a round (more rounds at one caller), requests summed.
        assert all(len(t["rounds"]) == rounds for t in result["targets"].values())
        assert result["rounds_paired"] == rounds
        assert set(result["pooled"]) == set(result["ratios"])
        assert set(result["standard_error"]) == set(result["ratios"])
        assert all(e is not None and e >= 0 for e in result["standard_error"].values())
        assert result["exported"]
        assert "gateway" in result["jaeger_services"]
        assert result["discarded"]
        assert result["sink"]["export_calls"] > 0
    five_off, five_on = (
        c1["targets"]["peer_five_process_off"],
        c1["targets"]["peer_five_process_exporting"],
    )
    # Paired round by round: the median of the rounds' differences.
    assert c1["ratios"]["five-process p50_added_ms"] == pytest.approx(
        statistics.median(
            b["p50_ms"] - a["p50_ms"]
            for a, b in zip(five_off["rounds"], five_on["rounds"], strict=True)
        )
    )
    # Beside it, the same with each request's own model compute taken out: every mesh
    # reply carries its compute time, so every round of every target has the figure.
    assert set(c1["less_compute"]) == set(c1["ratios"])
    assert all(isinstance(v, float) for v in c1["less_compute"].values())
    assert all(0 < r["p50_less_compute_ms"] < r["p50_ms"] for r in five_off["rounds"])
    colo_off, colo_on = (c32["targets"][f"peer_colocated_{v}"] for v in ("off", "exporting"))
    pairs = zip(colo_off["rounds"], colo_on["rounds"], strict=True)
    assert c32["ratios"]["colocated throughput_loss"] == pytest.approx(
        sum(1 - b["throughput_rps"] / a["throughput_rps"] for a, b in pairs) / 2
    )
    # The discarding mesh is paired with its own off windows, not the Jaeger mesh's.
    sink_off, sink_on = (
        c32["targets"][f"peer_colocated_{v}"] for v in ("discarding_off", "discarding")
    )
    pairs = zip(sink_off["rounds"], sink_on["rounds"], strict=True)
    assert c32["ratios"][f"colocated throughput_loss{DISCARDING_SUFFIX}"] == pytest.approx(
        sum(1 - b["throughput_rps"] / a["throughput_rps"] for a, b in pairs) / 2
    )
    rows = [r for r in tracing_targets(sc) if r["target"].startswith("tracing")]
    assert len(rows) == 2 * 2 * len(TOPOLOGIES)


def test_a_tracing_target_is_not_met_when_nothing_reached_jaeger() -> None:
    ratios = {"colocated p50_added_ms": 0.01, f"colocated p50_added_ms{DISCARDING_SUFFIX}": 0.01}
    result = {"ratios": ratios, "exported": False, "discarded": True, "jaeger_services": []}
    jaeger, sink = tracing_targets({"tracing_miss_c1": result})
    assert not jaeger["met"]
    assert "NOTHING REACHED JAEGER" in jaeger["how"]
    assert sink["met"]
    result |= {"exported": True, "discarded": False}
    jaeger, sink = tracing_targets({"tracing_miss_c1": result})
    assert jaeger["met"]
    assert not sink["met"]
    assert "NOTHING REACHED THE COLLECTOR" in sink["how"]
