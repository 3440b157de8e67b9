"""Tracing overhead: the same mesh with spans exported to Jaeger, and with no exporter.

Both variants run in one invocation, alternating (off, on, off, on, ...) so drift on a shared
machine hits both alike. Each round starts a fresh mesh, warms it, then runs a closed loop of
`--concurrency` callers sending unique texts with the cache bypassed (every request crosses
every hop) for `--duration` seconds. Reported: throughput, p50 and p99 per variant (medians
over rounds) and the ratios the issue's targets are written against.

Usage: .venv/bin/python bench/scripts/tracing_overhead.py [--rounds 3] [--duration 20]
       [--concurrency 4]
Needs the default model (`make model`) and Jaeger (`make .tools/bin/jaeger`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from hopline.observability.jaeger import LocalJaeger
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.launcher import Mesh
from hopline.runtime.service_table import Topology

ROOT = Path(__file__).resolve().parents[2]


def start_mesh(repo: Path, work: Path, extra: dict[str, str], topology: Topology) -> Mesh:
    return Mesh.on_free_ports(
        repo, work, addrs=topology.addrs(), env={"HOPLINE_LOG_LEVEL": "warning", **extra}
    ).start(timeout_s=180.0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(gateway: str, concurrency: int, duration_s: float, salt: str) -> list[float]:
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stop_at = time.monotonic() + duration_s
        counter = iter(range(10**9))

        async def caller() -> None:
            while time.monotonic() < stop_at:
                text = f"where is my order {salt}-{next(counter)}"
                started = time.perf_counter()
                await stub.Predict(
                    gateway_pb2.PredictRequest(text=text, cache_mode=common_pb2.CACHE_MODE_BYPASS),
                    timeout=30,
                )
                latencies.append((time.perf_counter() - started) * 1e3)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--bsp-delay-ms", type=int, default=200, help="OTEL_BSP_SCHEDULE_DELAY (hopline's default)"
    )
    parser.add_argument(
        "--bsp-batch", type=int, default=64, help="OTEL_BSP_MAX_EXPORT_BATCH_SIZE (hopline's)"
    )
    parser.add_argument(
        "--sample-ratio",
        type=float,
        help="head sampling for the 'on' variant (parentbased_traceidratio); default: "
        "hopline's own (observability/tracing.py:EXPORT_SAMPLE_RATIO)",
    )
    parser.add_argument(
        "--topology", type=Topology, default=Topology.COLOCATED, choices=list(Topology)
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hopline-trace-bench-"))
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with LocalJaeger(work) as jaeger:
        for rnd in range(args.rounds):
            for variant in ("off", "on"):
                extra = (
                    {
                        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp,
                        "OTEL_BSP_SCHEDULE_DELAY": str(args.bsp_delay_ms),
                        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(args.bsp_batch),
                    }
                    | (
                        {
                            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                            "OTEL_TRACES_SAMPLER_ARG": str(args.sample_ratio),
                        }
                        if args.sample_ratio is not None
                        else {}
                    )
                    if variant == "on"
                    else {}
                )
                run_dir = work / f"{variant}{rnd}"
                run_dir.mkdir()
                mesh = start_mesh(args.model_repo, run_dir, extra, args.topology)
                gateway, procs = mesh.gateway, list(mesh.procs.values())
                try:
                    asyncio.run(load(gateway, args.concurrency, args.warmup, f"w{rnd}{variant}"))
                    mesh_before = sum(cpu_s(p.pid) for p in procs)
                    jaeger_before = cpu_s(jaeger.pid)
                    lat = asyncio.run(
                        load(gateway, args.concurrency, args.duration, f"m{rnd}{variant}")
                    )
                    mesh_cpu = sum(cpu_s(p.pid) for p in procs) - mesh_before
                    jaeger_cpu = cpu_s(jaeger.pid) - jaeger_before
                finally:
                    mesh.stop(30.0)
                a = np.array(lat)
                row = {
                    "throughput_rps": len(a) / args.duration,
                    "p50_ms": float(np.percentile(a, 50)),
                    "p99_ms": float(np.percentile(a, 99)),
                    "requests": float(len(a)),
                    # CPU the five services spent per request: the SDK's own cost, free of
                    # the collector's (which shares these 2 cores here, not in production).
                    "mesh_cpu_ms_per_request": mesh_cpu * 1e3 / len(a),
                    "jaeger_cpu_share": jaeger_cpu / args.duration,
                }
                results[variant].append(row)
                print(
                    f"round {rnd} tracing {variant:<3} {row['throughput_rps']:7.1f} rps  "
                    f"p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  n={len(a)}  "
                    f"mesh CPU {row['mesh_cpu_ms_per_request']:.2f} ms/req  "
                    f"Jaeger {row['jaeger_cpu_share']:.0%} of a core",
                    flush=True,
                )
        services = jaeger.services()
    summary = {
        v: {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        for v, rows in results.items()
    }
    off, on = summary["off"], summary["on"]
    ratios = {
        "throughput_loss": 1 - on["throughput_rps"] / off["throughput_rps"],
        "p50_added_ms": on["p50_ms"] - off["p50_ms"],
        "p99_added_ms": on["p99_ms"] - off["p99_ms"],
        "mesh_cpu_added": on["mesh_cpu_ms_per_request"] / off["mesh_cpu_ms_per_request"] - 1,
    }
    lines = [
        f"\nmedian of {args.rounds} rounds, concurrency {args.concurrency}, "
        f"{args.duration:g} s each; Jaeger saw services {sorted(services)}",
        *(
            f"  {v:<4} {r['throughput_rps']:.1f} rps, p50 {r['p50_ms']:.2f} ms, "
            f"p99 {r['p99_ms']:.2f} ms"
            for v, r in summary.items()
        ),
        f"  throughput loss {ratios['throughput_loss']:.1%} (target <= 5%), "
        f"added p50 {ratios['p50_added_ms']:+.2f} ms (target <= 0.3 ms), "
        f"added p99 {ratios['p99_added_ms']:+.2f} ms",
        f"  mesh CPU per request {ratios['mesh_cpu_added']:+.1%}; Jaeger (same machine) used "
        f"{on['jaeger_cpu_share']:.0%} of a core",
    ]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "median": summary, **ratios}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
