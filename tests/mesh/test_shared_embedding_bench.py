"""`make bench`'s shared-embedding scenario: two real co-located meshes over a semantic copy
of the default model, one sharing the lookup's embedding and one not.

Short windows: this is about the scenario's plumbing (each mesh took the path it claims, the
rows come from the right pair of targets, a row is not met when the shared path was not
taken), not about its figures, which come from `make bench`.
"""

from __future__ import annotations

from pathlib import Path

from hopline.bench.shared_embedding import (
    shared_embedding_scenario,
    shared_embedding_targets,
)


def test_the_shared_mesh_answers_its_misses_from_the_lookups_embedding(
    default_repo: Path, tmp_path: Path
) -> None:
    sc = shared_embedding_scenario(default_repo, tmp_path, rounds=1, duration_s=1.0, warmup_s=0.3)
    for key in ("semantic_miss_c1", "semantic_miss_c32"):
        targets = sc[key]["targets"]
        for name in ("mesh", "peer_unshared"):
            assert targets[name]["requests"] > 0
            assert targets[name]["errors"] == 0
            assert targets[name]["cache_outcomes"].get("miss", 0) > 0, targets[name]
        assert "tokenize" not in targets["mesh"]["hops_ms"], targets["mesh"]["hops_ms"]
        assert sc[key]["shared_share"]["mesh"] == 1.0
        assert sc[key]["shared_share"]["peer_unshared"] == 0.0
    rows = shared_embedding_targets(sc)
    assert [r["target"].split(":")[0] for r in rows] == ["semantic_miss_c1", "semantic_miss_c32"]
    c1 = sc["semantic_miss_c1"]["targets"]
    assert rows[0]["value"] == c1["peer_unshared"]["p50_ms"] / c1["mesh"]["p50_ms"]


def test_a_row_is_not_met_when_the_shared_path_was_not_taken() -> None:
    target = {"p50_ms": 10.0, "throughput_rps": 100.0}
    sc = {
        "semantic_miss_c1": {
            "targets": {"mesh": target, "peer_unshared": {**target, "p50_ms": 20.0}},
            "shared_share": {"mesh": 0.0, "peer_unshared": 0.0},
        }
    }
    [row] = shared_embedding_targets(sc)
    assert row["value"] == 2.0
    assert not row["met"]
    assert "NOT TAKEN" in row["how"]
