"""Semantic searches in memory against in Milvus, in one run: two co-located meshes over the
default model with a `semantic` policy at threshold 1.0 (every lookup embeds and searches, none
hits, every miss stores: bench/shared_embedding.py's repository), `HOPLINE_CACHE_SEMANTIC_INDEX`
true (cache/vector_index.py) against false, measured as target and peer with alternated rounds
by `hopline bench --mix miss` at each concurrency, with the cache's own search time read from
its lookups (`search_ms`).

Usage: .venv/bin/python bench/scripts/semantic_index_ab.py [--concurrency 1,32] [--rounds 4]
       [--duration 40] [--prefill 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from hopline.bench.cli import bench_once
from hopline.bench.shared_embedding import (
    BUDGET_MS,
    MODEL,
    colocated_meshes,
    paired_windows,
    semantic_repo,
)
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def prefill(gateway: str, n: int, callers: int = 16) -> None:
    """`n` misses through the gateway, so the scope holds `n` entries before the windows."""
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def ask(i: int) -> None:
            text = f"prefilled question {i} about order {i * 7919 % 10007}"
            stub.Predict(gateway_pb2.PredictRequest(text=text, model=MODEL), timeout=60)

        with ThreadPoolExecutor(callers) as pool:
            list(pool.map(ask, range(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per target")
    parser.add_argument("--prefill", type=int, default=0, help="entries stored first")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-semantic-index-ab-"))
    repo = semantic_repo(args.model_repo, work)
    budget = {"HOPLINE_CACHE_BUDGET_MS": f"{BUDGET_MS:g}"}
    envs = {
        "memory": {"HOPLINE_CACHE_SEMANTIC_INDEX": "true", **budget},
        "milvus": {"HOPLINE_CACHE_SEMANTIC_INDEX": "false", **budget},
    }
    out: dict[str, Any] = {}
    with colocated_meshes(repo, work, envs) as meshes:
        for mesh in meshes.values():
            prefill(mesh.gateway, args.prefill)
        common = paired_windows(
            meshes["memory"], ("milvus", meshes["milvus"]), repo, args.rounds, args.duration, 3.0
        )
        for c in args.concurrency.split(","):
            result = bench_once(*common, "--concurrency", c, "--baseline", "none")
            out[f"c{c}"] = result
            for name, t in result["targets"].items():
                lookup = (t.get("hops_ms") or {}).get("cache_lookup", {})
                print(
                    f"c={c} {name:12s} rps {t['throughput_rps']:7.1f} p50 {t['p50_ms']:7.2f} "
                    f"p99 {t['p99_ms']:7.2f} cache_lookup p50 {lookup.get('p50', 0.0):.2f} ms",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
