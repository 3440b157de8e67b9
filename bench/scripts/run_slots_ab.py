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

from hopline.bench.cli import bench_once
from hopline.bench.shared_embedding import colocated_meshes
from hopline.runtime.service_table import Topology

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--topology", type=Topology, default=Topology.COLOCATED)
    parser.add_argument("--workers", default="0,2", help="values to compare, the first as target")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=32)
    load.add_argument("--rps", type=float)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=40.0)
    args = parser.parse_args()
    envs = {f"workers_{v}": {"HOPLINE_INFERENCE_WORKERS": v} for v in args.workers.split(",")}
    work = Path(tempfile.mkdtemp(prefix="hopline-run-slots-ab-"))
    with colocated_meshes(args.model_repo, work, envs, args.topology) as meshes:
        names = list(meshes)
        peers = [a for n in names[1:] for a in ("--peer", f"{n}={meshes[n].gateway}")]
        load_args = (
            ["--rps", f"{args.rps:g}"] if args.rps else ["--concurrency", f"{args.concurrency}"]
        )
        result = bench_once(
            *("--target", meshes[names[0]].gateway, *peers, *load_args),
            *("--mix", "miss", "--baseline", "none", "--model-repo", str(args.model_repo)),
            *("--rounds", str(args.rounds), "--duration", f"{args.duration:g}"),
        )
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
