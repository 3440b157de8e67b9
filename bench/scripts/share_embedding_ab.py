"""Semantic misses with the lookup's embedding shared against not, in one run.

A scratch repository holds the default model with its cache policy set to `semantic` (the
policy is config, as an operator would set it). Two co-located meshes serve it, one with
`HOPLINE_GATEWAY_SHARE_EMBEDDINGS=true` (the model runs its head on the cache lookup's
query embedding) and one with `false` (tokens, the whole model, speculation beside the
lookup's own encoder run). `hopline bench --mix miss` measures both as target and peer with
alternated rounds, at concurrency 1 against echo and in-process, and at 32 against the
in-process batched pipeline.

Usage: .venv/bin/python bench/scripts/share_embedding_ab.py [--rounds 3] [--duration 8]
       [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hopline.bench.cli import bench_once
from hopline.runtime.launcher import Mesh
from hopline.runtime.service_table import Topology

ROOT = Path(__file__).resolve().parents[2]
MODEL = "support-intents"


def semantic_repo(source: Path, work: Path, threshold: float) -> Path:
    repo = work / "models"
    target = repo / MODEL / "1"
    shutil.copytree(source / MODEL / "1", target)
    cfg = json.loads((target / "config.json").read_text())
    if not cfg.get("head_embedder"):
        raise SystemExit(f"{source} has no head: rebuild it (`rm -r models; make model`)")
    cfg["cache"].update(mode="semantic", threshold=threshold)
    (target / "config.json").write_text(json.dumps(cfg))
    return repo


def summary(result: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {k: round(t[k], 2) for k in ("throughput_rps", "p50_ms", "p99_ms")}
        | {"errors": t["errors"], "outcomes": t["cache_outcomes"]}
        for name, t in result["targets"].items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--json", type=Path)
    # 1.0: every lookup embeds and searches, and only an identical vector hits: the miss
    # path of a semantic policy (the miss mix's texts are templated, so 0.9 would hit).
    parser.add_argument("--threshold", type=float, default=1.0)
    parser.add_argument(
        "--budget-ms", type=float, help="HOPLINE_CACHE_BUDGET_MS for both (default: its own)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-share-ab-"))
    repo = semantic_repo(args.model_repo, work, args.threshold)
    budget = {"HOPLINE_CACHE_BUDGET_MS": f"{args.budget_ms:g}"} if args.budget_ms else {}
    meshes: dict[str, Mesh] = {}
    try:
        for name, share in (("shared", "true"), ("unshared", "false")):
            (work / name).mkdir()
            meshes[name] = Mesh.on_free_ports(
                repo,
                work / name,
                addrs=Topology.COLOCATED.addrs(),
                env={"HOPLINE_GATEWAY_SHARE_EMBEDDINGS": share, **budget},
            ).start(timeout_s=180.0)
        common = [
            "--target",
            meshes["shared"].gateway,
            "--peer",
            f"unshared={meshes['unshared'].gateway}",
            "--mix",
            "miss",
            "--model-repo",
            str(repo),
            "--rounds",
            str(args.rounds),
            "--duration",
            f"{args.duration / args.rounds:g}",
        ]
        doc = {
            "c1": bench_once(*common, "--concurrency", "1", "--baseline", "echo,inprocess"),
            "c32": bench_once(*common, "--concurrency", "32", "--baseline", "inprocess_batched"),
        }
    finally:
        for mesh in meshes.values():
            mesh.stop()
    out = args.json or work / "bench.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: summary(v) for k, v in doc.items()}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
