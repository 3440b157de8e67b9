"""`make bench`'s full-cache scenario: two real co-located meshes, one whose cache is filled
to its bound (here HOPLINE_CACHE_MAX_ENTRIES, small, so the fill is short) and one empty.

Short windows: this is about the scenario's plumbing (the full cache really was full and
evicted under the benchmark's stores, the empty one did not, the row compares the right
pair), not about its figures, which come from `make bench`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hopline.bench.full_cache import (
    EMPTY,
    FULL,
    KEY,
    LIMIT,
    full_cache_scenario,
    full_cache_targets,
)

BOUND = 2000  # above what the empty mesh stores in its window, so it never evicts


def test_the_full_cache_evicts_under_the_benchmark_and_the_empty_one_does_not(
    default_repo: Path, tmp_path: Path
) -> None:
    sc = full_cache_scenario(
        default_repo, tmp_path, rounds=1, duration_s=2.0, warmup_s=0.3, bound=BOUND
    )
    result = sc[KEY]
    for name in ("mesh", f"peer_{EMPTY}"):
        target = result["targets"][name]
        assert target["requests"] > 0
        assert target["errors"] == 0
        assert target["cache_outcomes"].get("miss", 0) > 0, target
    assert result["cache"]["prefilled"] == result["cache"]["bound"] == BOUND
    assert result["cache"]["evictions"][FULL] > 0
    assert result["cache"]["evictions"][EMPTY] == 0
    [row] = full_cache_targets(sc)
    t = result["targets"]
    assert row["value"] == t["mesh"]["throughput_rps"] / t[f"peer_{EMPTY}"]["throughput_rps"]
    assert "DID NOT EVICT" not in row["how"]


def test_a_row_is_not_met_when_the_full_cache_did_not_evict() -> None:
    target: dict[str, Any] = {"throughput_rps": 100.0, "p99_ms": 10.0}
    sc = {
        KEY: {
            "targets": {"mesh": target, f"peer_{EMPTY}": target},
            "cache": {"bound": 100, "prefilled": 100, "evictions": {FULL: 0, EMPTY: 0}},
        }
    }
    [row] = full_cache_targets(sc)
    assert row["value"] == 1.0 >= LIMIT
    assert not row["met"]
    assert "DID NOT EVICT" in row["how"]
