"""Semantic lookups with concurrent searches batched into one Milvus call against each alone,
in one run: two co-located meshes over the default model with a `semantic` policy at
threshold 1.0 (every lookup embeds and searches, none hits; bench/shared_embedding.py's
repository), `HOPLINE_CACHE_SEARCH_BATCH_ROWS=64` (the default) against `1`, measured as
target and peer with alternated rounds by `hopline bench --mix miss`.

Usage: .venv/bin/python bench/scripts/search_batch_ab.py [--concurrency 8,32] [--rounds 3]
       [--duration 12] [--budget-ms 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from hopline.bench.cli import bench_once
from hopline.bench.shared_embedding import colocated_meshes, semantic_repo

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--budget-ms", type=float, default=40.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-search-batch-ab-"))
    repo = semantic_repo(args.model_repo, work)
    # Searches in Milvus, not in memory (cache/vector_index.py): the batching is Milvus's.
    budget = {
        "HOPLINE_CACHE_BUDGET_MS": f"{args.budget_ms:g}",
        "HOPLINE_CACHE_SEMANTIC_INDEX": "false",
    }
    envs = {
        "batched": {"HOPLINE_CACHE_SEARCH_BATCH_ROWS": "64", **budget},
        "alone": {"HOPLINE_CACHE_SEARCH_BATCH_ROWS": "1", **budget},
    }
    out: dict[str, Any] = {}
    with colocated_meshes(repo, work, envs) as meshes:
        for c in args.concurrency.split(","):
            out[f"c{c}"] = bench_once(
                "--target", meshes["batched"].gateway,
                "--peer", f"alone={meshes['alone'].gateway}",
                "--mix", "miss", "--model-repo", str(repo), "--baseline", "none",
                "--concurrency", c, "--rounds", str(args.rounds),
                "--duration", f"{args.duration / args.rounds:g}", "--warmup", "3",
            )  # fmt: skip
    path = args.json or work / "bench.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for key, result in out.items():
        for name, t in result["targets"].items():
            lookup = t.get("hops_ms", {}).get("cache_lookup", {})
            print(
                f"{key} {name}: {t['throughput_rps']:.1f} rps, p50 {t['p50_ms']:.2f} ms, "
                f"p99 {t['p99_ms']:.2f} ms, cache_lookup p50 {lookup.get('p50', float('nan')):.2f}"
                f" ms, outcomes {t['cache_outcomes']}"
            )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
