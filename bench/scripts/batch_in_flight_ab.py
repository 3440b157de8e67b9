"""Gateway batching with one stage RPC in flight per stage and model against two, in one run:
a mesh per HOPLINE_GATEWAY_BATCH_IN_FLIGHT value over the default model, measured as target
and peers with alternated rounds by `hopline bench --mix miss` (closed loop, or open loop with
--rps), and each mesh's stage RPCs per request counted from its services' /metrics (five
processes only: co-located stages are not RPCs on a port).

The measurement behind the default of 1 (gateway/config.py:GatewayConfig.batch_in_flight).

Usage: .venv/bin/python bench/scripts/batch_in_flight_ab.py [--topology five-process]
       [--in-flight 2,1] [--concurrency 32 | --rps 95] [--rounds 6] [--duration 36]
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
from hopline.runtime.launcher import Mesh, rpcs_answered
from hopline.runtime.service_table import Topology

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"tokenizer": "Tokenize", "inference": "Infer", "postprocess": "Postprocess"}


def answered(mesh: Mesh, service: str, method: str) -> float:
    """RPCs of `method` the mesh's `service` process has answered."""
    return rpcs_answered(mesh.metrics_ports[service], method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--topology", type=Topology, default=Topology.FIVE_PROCESS)
    parser.add_argument("--in-flight", default="2,1", help="values to compare, the first as target")
    add_ab_load_arguments(parser, rounds=6, duration_s=36.0)
    args = parser.parse_args()
    values = args.in_flight.split(",")
    envs = {f"in_flight_{v}": {"HOPLINE_GATEWAY_BATCH_IN_FLIGHT": v} for v in values}
    work = Path(tempfile.mkdtemp(prefix="hopline-in-flight-ab-"))
    five = args.topology is Topology.FIVE_PROCESS
    with colocated_meshes(args.model_repo, work, envs, args.topology) as meshes:
        names = list(meshes)
        counted = ("gateway", "Predict"), *STAGES.items()
        before = {n: [answered(meshes[n], *c) for c in counted] for n in names if five}
        result = alternated_misses(meshes, args.model_repo, args)
        for name, target in zip(names, result["targets"].values(), strict=True):
            line = (
                f"{name}: {target['throughput_rps']:.1f} rps, p50 {target['p50_ms']:.2f} ms, "
                f"p99 {target['p99_ms']:.2f} ms, errors {target['errors']}"
            )
            if five:
                after = [answered(meshes[name], *c) for c in counted]
                done = [b - a for a, b in zip(before[name], after, strict=True)]
                per = ", ".join(
                    f"{method} {d / done[0]:.2f}"
                    for (_, method), d in zip(counted[1:], done[1:], strict=True)
                )
                line += f"; RPCs per request: {per}"
            print(line)


if __name__ == "__main__":
    main()
