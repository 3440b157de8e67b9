"""FP32 against INT8 in one run: model compute alone, in-process, and through the mesh.

The scenario `make bench` records as `precision_ab` (hopline.bench.precision), alone: the
default model's FP32 version 1 and an INT8 version 2 built beside it in a scratch repository,
a mesh of its own, and `hopline bench --models support-intents:1,support-intents:2` with
rounds, so FP32 and INT8 windows alternate on a shared machine.

Usage: .venv/bin/python bench/scripts/precision_ab.py [--rounds 3] [--duration 8]
       [--work DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hopline.bench.precision import precision_scenario

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--compute-iterations", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="hopline-precision-ab-"))
    doc = precision_scenario(
        args.model_repo,
        work,
        rounds=args.rounds,
        duration_s=args.duration,
        iterations=args.compute_iterations,
    )
    out = args.json or work / "bench.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: round(v, 3) for k, v in doc["ratios"].items()}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
