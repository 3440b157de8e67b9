"""The model's run slots on the CPU, one per core against one per core and one more, in one
run: a co-located mesh per HOPLINE_INFERENCE_WORKERS value over the default model, measured as
target and peers with alternated rounds by `hopline bench --mix miss` (closed loop, or open
loop with --rps), each round's figures printed.

`0` is the default (model/run_width.py:run_slots: one slot more than there are cores); `2` on
a 2-core machine is one per core.

Usage: .venv/bin/python bench/scripts/run_slots_ab.py [--workers 0,2] [--topology colocated]
       [--concurrency 32 | --rps 240] [--rounds 4] [--duration 40]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hopline.bench.shared_embedding import (
    add_ab_load_arguments,
    alternated_misses,
    colocated_meshes,
)
from hopline.runtime.service_table import Topology

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--topology", type=Topology, default=Topology.COLOCATED)
    parser.add_argument("--workers", default="0,2", help="values to compare, the first as target")
    add_ab_load_arguments(parser, rounds=4, duration_s=40.0)
    args = parser.parse_args()
    envs = {f"workers_{v}": {"HOPLINE_INFERENCE_WORKERS": v} for v in args.workers.split(",")}
    work = Path(tempfile.mkdtemp(prefix="hopline-run-slots-ab-"))
    with colocated_meshes(args.model_repo, work, envs, args.topology) as meshes:
        names = list(meshes)
        result = alternated_misses(meshes, args.model_repo, args)
    for name, target in zip(names, result["targets"].values(), strict=True):
        rounds = "; ".join(
            f"{r['throughput_rps']:.1f} rps p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f}"
            for r in target["rounds"]
        )
        print(
            f"{name}: {target['throughput_rps']:.1f} rps, p50 {target['p50_ms']:.2f} ms, "
            f"p99 {target['p99_ms']:.2f} ms, errors {target['errors']}; rounds: {rounds}"
        )


if __name__ == "__main__":
    main()
