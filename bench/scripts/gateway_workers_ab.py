"""Gateway workers (HOPLINE_GATEWAY_WORKERS) against one gateway process: co-located meshes side
by side, one per worker count, over the same model, measured by one `hopline bench` run whose
rounds alternate between them, over several connections (each reaches one worker). For
machines with cores to spare (runtime/workers.py); on a GPU machine pass --providers cuda,cpu
so the model is not what limits the mesh.

Usage: python bench/scripts/gateway_workers_ab.py --work DIR [--workers 1,4,8]
       [--providers cuda,cpu] [--concurrency 64] [--connections 16] [--mix miss]
       [--rounds 3] [--duration 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hopline.bench.cli import bench_once
from hopline.model.build import DEFAULT_MODEL_NAME, DEFAULT_TRAIN_FILE, build_model
from hopline.runtime.launcher import Mesh
from hopline.runtime.service_table import Topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--workers", default="1,4,8")
    parser.add_argument("--providers", default="cpu")
    parser.add_argument("--concurrency", default="64")
    parser.add_argument("--connections", default="16")
    parser.add_argument("--mix", default="miss")
    parser.add_argument("--rounds", default="3")
    parser.add_argument("--duration", default="6")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    repo = args.work / "models"
    if not (repo / DEFAULT_MODEL_NAME / "1").is_dir():
        build_model(
            DEFAULT_TRAIN_FILE, DEFAULT_MODEL_NAME, repo, providers=args.providers.split(",")
        )
    meshes: dict[str, Mesh] = {}
    try:
        for n in args.workers.split(","):
            work = args.work / f"workers-{n}"
            work.mkdir(parents=True, exist_ok=True)
            gateway = {"HOPLINE_GATEWAY_WORKERS": n}
            meshes[f"workers_{n}"] = Mesh.on_free_ports(
                repo, work, addrs=Topology.COLOCATED.addrs(), service_env={"gateway": gateway}
            ).start(timeout_s=300)
        names = list(meshes)
        argv = ["--target", meshes[names[0]].gateway]
        for name in names[1:]:
            argv += ["--peer", f"{name}={meshes[name].gateway}"]
        result: dict[str, Any] = bench_once(
            *argv, "--concurrency", args.concurrency, "--mix", args.mix, "--baseline", "none",
            "--connections", args.connections,
            "--rounds", args.rounds, "--duration", args.duration, "--warmup", "2",
            "--model-repo", str(repo),
        )  # fmt: skip
    finally:
        for mesh in meshes.values():
            mesh.stop()
    print(f"cores {os.cpu_count()}, concurrency {args.concurrency}, providers {args.providers}")
    for target, t in result["targets"].items():
        name = names[0] if target == "mesh" else target.removeprefix("peer_")
        total = (t.get("hops_ms") or {}).get("total", {})
        print(
            f"{name:<16} {t['throughput_rps']:8.1f} rps  p50 {t['p50_ms']:7.2f}  "
            f"p99 {t['p99_ms']:7.2f} ms  errors {t['errors']}  gateway total p50 "
            f"{total.get('p50', float('nan')):.2f} ms  loadgen {t.get('loadgen_cpu_core_share')}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
