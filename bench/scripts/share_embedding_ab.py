"""Semantic misses with the lookup's embedding shared against not, in one run: the
scenario `make bench` records as `semantic_miss_c1` / `_c32` (hopline.bench.shared_embedding),
alone.

Usage: .venv/bin/python bench/scripts/share_embedding_ab.py [--rounds 3] [--duration 12]
       [--budget-ms 2000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hopline.bench.shared_embedding import BUDGET_MS, shared_embedding_scenario

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--budget-ms", type=float, default=BUDGET_MS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-share-ab-"))
    sc = shared_embedding_scenario(
        args.model_repo,
        work,
        rounds=args.rounds,
        duration_s=args.duration,
        budget_ms=args.budget_ms,
    )
    out = args.json or work / "bench.json"
    out.write_text(json.dumps(sc, indent=1) + "\n")
    for key, result in sc.items():
        for name, t in result["targets"].items():
            print(
                f"{key} {name}: {t['throughput_rps']:.1f} rps, p50 {t['p50_ms']:.2f} ms, "
                f"p99 {t['p99_ms']:.2f} ms, outcomes {t['cache_outcomes']}, "
                f"shared {result['shared_share'][name]:.2f}"
            )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
