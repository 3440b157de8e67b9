"""`make bench`'s tracing scenario: four real meshes, two exporting to a real Jaeger.

Short windows: this is about the scenario's plumbing (the exporting meshes' spans reach
Jaeger, each ratio comes from the right pair of targets, a target is not met when no span
arrived),
not about its figures, which come from `make bench`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hopline.bench.tracing import TOPOLOGIES, tracing_scenario, tracing_targets


def test_tracing_scenario_measures_each_topology_exporting_and_not(
    default_repo: Path, tmp_path: Path
) -> None:
    sc = tracing_scenario(default_repo, tmp_path, rounds=1, duration_s=0.6, warmup_s=0.2)

    c1, c32 = sc["tracing_miss_c1"], sc["tracing_miss_c32"]
    names = [
        f"peer_{t.value.replace('-', '_')}_{v}" for t in TOPOLOGIES for v in ("off", "exporting")
    ]
    for result in (c1, c32):
        assert list(result["targets"]) == names
        assert all(t["requests"] > 0 and t["errors"] == 0 for t in result["targets"].values())
        assert result["exported"]
        assert "gateway" in result["jaeger_services"]
    five_off, five_on = (
        c1["targets"]["peer_five_process_off"],
        c1["targets"]["peer_five_process_exporting"],
    )
    assert c1["ratios"]["five-process p50_added_ms"] == pytest.approx(
        five_on["p50_ms"] - five_off["p50_ms"]
    )
    colo_off, colo_on = (c32["targets"][f"peer_colocated_{v}"] for v in ("off", "exporting"))
    assert c32["ratios"]["colocated throughput_loss"] == pytest.approx(
        1 - colo_on["throughput_rps"] / colo_off["throughput_rps"]
    )
    rows = [r for r in tracing_targets(sc) if r["target"].startswith("tracing")]
    assert len(rows) == 2 * len(TOPOLOGIES)


def test_a_tracing_target_is_not_met_when_nothing_reached_jaeger() -> None:
    ratios = {"colocated p50_added_ms": 0.01}
    sc = {"tracing_miss_c1": {"ratios": ratios, "exported": False, "jaeger_services": []}}
    [row] = [r for r in tracing_targets(sc) if r["target"].startswith("tracing")]
    assert not row["met"]
    assert "NOTHING REACHED JAEGER" in row["how"]
