"""What exporting spans over mutual TLS costs against plaintext export, the collector alike.

Two Jaeger v2 processes on deploy/observability/jaeger.yaml (addresses changed with
`--set`): one with the file's mutual-TLS receiver, one with TLS taken off. Rounds alternate
(plain, tls, plain, tls, ...), each on a fresh mesh exporting every trace
(parentbased_always_on: the most spans a mesh can send) to one of them, with a closed loop
of `--concurrency` callers sending unique texts with the cache bypassed. Reported per variant
(medians over rounds): throughput, p50, p99 and the mesh's CPU per request.

Usage: .venv/bin/python bench/scripts/otlp_tls_cost.py [--rounds 4] [--duration 15]
Needs the default model (`make model`), Jaeger (`make jaeger`) and the `openssl` command.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracing_overhead import cpu_s, load, start_mesh

from hopline.cli.certs import make_certs
from hopline.observability.jaeger import BINARY
from hopline.runtime.ports import free_ports
from hopline.runtime.service_table import Topology

ROOT = Path(__file__).resolve().parents[2]
RECEIVER = "receivers::otlp::protocols::grpc::"


def jaeger(work: Path, certs: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    """deploy/observability/jaeger.yaml on free ports; TLS off without `certs`."""
    otlp, query, query_grpc = free_ports(3)
    sets = {
        RECEIVER + "endpoint": f"127.0.0.1:{otlp}",
        "extensions::jaeger_query::http::endpoint": f"127.0.0.1:{query}",
        "extensions::jaeger_query::grpc::endpoint": f"127.0.0.1:{query_grpc}",
        "service::telemetry::metrics::level": "none",
    }
    if certs is None:
        sets[RECEIVER + "tls"] = "null"
    else:
        sets |= {
            RECEIVER + "tls::cert_file": str(certs / "jaeger-collector.crt"),
            RECEIVER + "tls::key_file": str(certs / "jaeger-collector.key"),
            RECEIVER + "tls::client_ca_file": str(certs / "ca.crt"),
        }
    config = ROOT / "deploy" / "observability" / "jaeger.yaml"
    log = (work / f"jaeger-{'tls' if certs else 'plain'}.log").open("ab")
    proc = subprocess.Popen(
        [str(BINARY), "--config", str(config), *(f"--set={k}={v}" for k, v in sets.items())],
        stdout=log,
        stderr=log,
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", otlp), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    scheme = "https" if certs else "http"
    return proc, f"{scheme}://127.0.0.1:{otlp}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument(
        "--topology", type=Topology, default=Topology.COLOCATED, choices=list(Topology)
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-otlp-tls-"))
    certs = make_certs(work / "tls", ("jaeger-collector", "client"))
    plain, plain_url = jaeger(work, None)
    tls, tls_url = jaeger(work, certs)
    common = {"OTEL_TRACES_SAMPLER": "parentbased_always_on", "HOPLINE_LOG_LEVEL": "warning"}
    variants = {
        "plain": {**common, "OTEL_EXPORTER_OTLP_ENDPOINT": plain_url},
        "tls": {
            **common,
            "OTEL_EXPORTER_OTLP_ENDPOINT": tls_url,
            "OTEL_EXPORTER_OTLP_CERTIFICATE": str(certs / "ca.crt"),
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(certs / "client.crt"),
            "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(certs / "client.key"),
        },
    }
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    try:
        for rnd in range(args.rounds):
            for name, env in variants.items():
                run_dir = work / f"{name}{rnd}"
                run_dir.mkdir()
                mesh = start_mesh(args.model_repo, run_dir, env, args.topology)
                procs = list(mesh.procs.values())
                try:
                    asyncio.run(load(mesh.gateway, args.concurrency, args.warmup, f"w{rnd}{name}"))
                    before = sum(cpu_s(p.pid) for p in procs)
                    lat = np.array(
                        asyncio.run(
                            load(mesh.gateway, args.concurrency, args.duration, f"m{rnd}{name}")
                        )
                    )
                    cpu = sum(cpu_s(p.pid) for p in procs) - before
                finally:
                    mesh.stop(30.0)
                row = {
                    "rps": len(lat) / args.duration,
                    "p50_ms": float(np.percentile(lat, 50)),
                    "p99_ms": float(np.percentile(lat, 99)),
                    "cpu_ms_per_request": cpu * 1e3 / len(lat),
                }
                rows[name].append(row)
                print(
                    f"round {rnd} {name:<5} {row['rps']:7.1f} rps  p50 {row['p50_ms']:6.2f} ms  "
                    f"p99 {row['p99_ms']:6.2f} ms  mesh CPU {row['cpu_ms_per_request']:.2f} ms/req",
                    flush=True,
                )
    finally:
        for proc in (plain, tls):
            proc.terminate()
            proc.wait(timeout=20)
    print(f"\nmedian of {args.rounds} rounds, concurrency {args.concurrency}:")
    for name, runs in rows.items():
        med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        print(
            f"  {name:<5} {med['rps']:.1f} rps, p50 {med['p50_ms']:.2f} ms, "
            f"p99 {med['p99_ms']:.2f} ms, mesh CPU {med['cpu_ms_per_request']:.2f} ms/req"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
