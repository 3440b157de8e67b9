"""TLS overhead: one mesh in plaintext and one over mTLS, measured by `hopline bench`.

Both meshes run side by side for the whole invocation (one idles while the other is
measured), and `hopline bench --baseline none` loads them in turn, alternating in ABBA order
(plain, tls, tls, plain, ...), so drift on a shared machine hits both alike. Reported: p50 and
p99 per variant per round, their medians over rounds, and the TLS/plain ratios.

Usage: .venv/bin/python bench/scripts/tls_overhead.py [--rounds 3] [--duration 20]
       [--concurrency 1] [--mix miss]
Needs the default model (`make model`) and the `openssl` command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hopline.cli.certs import env_for, make_certs
from hopline.runtime.launcher import Mesh

ROOT = Path(__file__).resolve().parents[2]


def bench(
    gateway: str, env: dict[str, str], args: argparse.Namespace, out: Path
) -> dict[str, float]:
    subprocess.run(
        [
            sys.executable, "-m", "hopline", "bench", "--baseline", "none",
            "--target", gateway, "--concurrency", str(args.concurrency), "--mix", args.mix,
            "--duration", str(args.duration), "--warmup", str(args.warmup), "--json", str(out),
        ],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    mesh: dict[str, float] = json.loads(out.read_text())["targets"]["mesh"]
    return mesh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--mix", default="miss")
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-tls-bench-"))
    tls_env = env_for(make_certs(work / "certs"))
    quiet = {"HOPLINE_LOG_LEVEL": "warning"}
    for folder in ("plain", "tls"):
        (work / folder).mkdir()
    plain = Mesh.on_free_ports(args.model_repo, work / "plain", env=quiet)
    secure = Mesh.on_free_ports(args.model_repo, work / "tls", env={**quiet, **tls_env})
    results: dict[str, list[dict[str, float]]] = {"plain": [], "tls": []}
    try:
        plain.start(timeout_s=180.0)
        secure.start(timeout_s=180.0)
        variants = [
            ("plain", plain, dict(os.environ)),
            ("tls", secure, {**os.environ, **tls_env}),
        ]
        for r in range(args.rounds):
            # ABBA: neither variant always goes first after the other one's load.
            for name, mesh, env in variants if r % 2 == 0 else variants[::-1]:
                got = bench(mesh.gateway, env, args, work / f"{name}-{r}.json")
                results[name].append(got)
                print(
                    f"round {r} {name:<5} p50 {got['p50_ms']:.2f} ms  p99 {got['p99_ms']:.2f} ms"
                    f"  {got['throughput_rps']:.1f} rps  n={got['requests']}"
                    f"  errors={got['errors']}",
                    flush=True,
                )
    finally:
        plain.stop()
        secure.stop()
    summary = {
        name: {key: statistics.median(run[key] for run in runs) for key in ("p50_ms", "p99_ms")}
        for name, runs in results.items()
    }
    for name, s in summary.items():
        print(f"median {name:<5} p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms")
    for key in ("p50_ms", "p99_ms"):
        print(f"tls/plain {key}: {summary['tls'][key] / summary['plain'][key]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
