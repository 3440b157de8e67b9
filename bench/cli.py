"""`hopline bench`: load a running gateway and, in the same run, the baselines it must beat.

Targets are measured one after the other, never at once (they share the cores): the bare
gRPC echo (the transport's floor), the in-process pipeline without and with the inference
service's dynamic batching, the mesh, then any peers. Each gets the same mix, the same
warm-up and the same window.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from hopline.bench.load import Run, closed_loop, cpu_count, open_loop
from hopline.bench.mixes import Mix, make_mix
from hopline.bench.report import ratios, summarise, table, write_png
from hopline.bench.targets import (
    EchoTarget,
    InProcessTarget,
    PredictTarget,
    Target,
    inprocess_threads,
)
from hopline.gateway.client import CACHE_MODES, gateway_address

BASELINES = ("echo", "inprocess", "inprocess_batched")
DESCRIPTION = """\
Load a running hopline gateway and the baselines it must beat, one after the other, in one
run: `echo` (a bare grpc.aio echo server it starts: the transport's floor), `inprocess` (the
same tokenizer, model and postprocessing in this process, one request per run, in its
strongest plain thread setting) and `inprocess_batched` (the same, through the inference
service's own dynamic batcher and settings). Peers (`--peer ray=ADDR`) speaking hopline's
Predict are measured the same way.

How the load generator stays light on a 2-core machine: it is one process with one event
loop and one gRPC connection per target; requests are serialised before the window and sent
as raw bytes; responses are decoded after the window; latencies go into an HDR histogram
afterwards. It reports its own CPU share (`loadgen CPU`, of one core) for every target, and
how busy the machine was, so a saturated load generator is visible rather than hidden.
"""


def add_bench_command(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure the mesh against echo, in-process and peer baselines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        help="gateway address [env HOPLINE_GATEWAY_ADDR; default 127.0.0.1:8001]; "
        "'none' measures only the baselines",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop with N callers (default 1)")
    load.add_argument("--rps", type=float, help="open loop: Poisson arrivals at R per second")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per target")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first")
    p.add_argument("--mix", default="miss", choices=("miss", "exact", "semantic", "clinc"))
    p.add_argument("--clinc", type=Path, help="CLINC150 data_full.json (default: ../shared)")
    p.add_argument(
        "--baseline",
        default="echo,inprocess,inprocess_batched",
        help="comma-separated: echo, inprocess, inprocess_batched, or none",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=ADDR",
        help="a peer speaking hopline.gateway.v1 Predict, reported as peer_NAME (repeatable)",
    )
    p.add_argument("--model", default="", help="model to request (default: the gateway's)")
    p.add_argument("--model-repo", default=os.environ.get("HOPLINE_MODEL_REPO", "models"))
    p.add_argument("--tenant", default="", help="tenant for the mesh's requests")
    p.add_argument("--cache", default="use", choices=("use", "bypass"), help="mesh cache mode")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request deadline, seconds")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, help="write a latency CDF per target here")
    p.add_argument(
        "--loop",
        default="asyncio",
        choices=("asyncio", "uvloop"),
        help="the load generator's event loop",
    )


def _start_echo() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hopline.bench.echo", "--listen", address],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if line != "READY":
        proc.kill()
        raise SystemExit(f"the echo server did not start (said {line!r})")
    return proc, address


class _Payloads:
    """Payloads built before the window; a miss mix past the prepared ones builds on demand."""

    def __init__(self, target: Target, mix: Mix, count: int) -> None:
        self.target, self.mix = target, mix
        n = count if mix.distinct is None else min(count, mix.distinct)
        self.items = [target.payload(mix.text(i)) for i in range(n)]

    def __call__(self, i: int) -> Any:
        if i < len(self.items):
            return self.items[i]
        if self.mix.distinct is not None:
            return self.items[i % len(self.items)]
        return self.target.payload(self.mix.text(i))


async def measure(target: Target, mix: Mix, args: argparse.Namespace) -> Run:
    for text in mix.prime:  # exact and semantic mixes: fill the cache first
        await target.call(target.payload(text))
    seconds = args.duration + args.warmup
    expected = args.rps * seconds if args.rps else (args.concurrency or 1) * 300 * seconds
    payloads = _Payloads(target, mix, int(expected * 1.3) + 1000)
    if args.rps:
        return await open_loop(
            target.call, payloads, rps=args.rps, duration_s=args.duration, warmup_s=args.warmup
        )
    return await closed_loop(
        target.call,
        payloads,
        concurrency=args.concurrency or 1,
        duration_s=args.duration,
        warmup_s=args.warmup,
    )


def _inprocess(name: str, args: argparse.Namespace) -> InProcessTarget:
    from hopline.model.repository import ModelRepository
    from hopline.runtime import config as cfg
    from hopline.services.inference.service import InferenceConfig

    model = args.model or os.environ.get("HOPLINE_DEFAULT_MODEL", "support-intents")
    config = ModelRepository(Path(args.model_repo)).resolve(model)
    if name == "inprocess":
        workers, threads = inprocess_threads(args.concurrency or (cpu_count() if args.rps else 1))
        return InProcessTarget(config, batched=False, workers=workers, threads=threads)
    service = cfg.load(InferenceConfig, [])  # the inference service's settings, from env
    return InProcessTarget(
        config, batched=True, workers=max(1, service.workers), threads=service.threads
    )


async def run_targets(args: argparse.Namespace) -> tuple[dict[str, Run], dict[str, Any]]:
    baselines = [b for b in args.baseline.split(",") if b and b != "none"]
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise SystemExit(f"unknown baseline(s) {sorted(unknown)}: {', '.join(BASELINES)}")
    runs: dict[str, Run] = {}
    records: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    cache_mode = CACHE_MODES[args.cache]
    queue: list[str] = [*baselines]
    if args.target != "none":
        queue.append("mesh")
    queue += [f"peer_{p.split('=', 1)[0]}" for p in args.peer]
    peers = dict(p.split("=", 1) for p in args.peer)
    for name in queue:
        mix = make_mix(args.mix, args.clinc)
        echo_proc = None
        target: Target
        if name == "echo":
            echo_proc, address = _start_echo()
            target = EchoTarget(address)
        elif name.startswith("inprocess"):
            target = _inprocess(name, args)
            settings[name] = target.settings
        else:
            address = gateway_address(args.target) if name == "mesh" else peers[name[5:]]
            target = PredictTarget(
                name,
                address,
                model=args.model,
                tenant=args.tenant,
                cache_mode=cache_mode,
                timeout_s=args.timeout,
            )
        try:
            sys.stderr.write(f"measuring {name} ({args.mix}) ...\n")
            runs[name] = await measure(target, mix, args)
            records[name] = summarise(runs[name], target.describe)
        finally:
            await target.close()
            if echo_proc is not None:
                echo_proc.terminate()
                echo_proc.wait(timeout=10)
    return runs, {"targets": records, "settings": settings}


def run_bench(args: argparse.Namespace) -> int:
    if args.concurrency is None and args.rps is None:
        args.concurrency = 1
    if args.loop == "uvloop":
        import uvloop

        runs, result = uvloop.run(run_targets(args))
    else:
        runs, result = asyncio.run(run_targets(args))
    load = f"rps {args.rps:g} (open loop)" if args.rps else f"concurrency {args.concurrency}"
    doc = {
        "hopline_bench": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cores": cpu_count(),
        "config": {
            "target": args.target or gateway_address(None),
            "mix": args.mix,
            "concurrency": args.concurrency,
            "rps": args.rps,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "cache": args.cache,
            "model": args.model,
            "loop": args.loop,
        },
        **result,
        "ratios": ratios(result["targets"]),
    }
    sys.stdout.write(f"\nhopline bench: mix {args.mix}, {load}, {args.duration:g} s each\n")
    sys.stdout.write(table(result["targets"]) + "\n")
    for key, value in doc["ratios"].items():
        sys.stdout.write(f"  {key:<45} {value:.3f}\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        write_png(runs, args.png, f"hopline bench: {args.mix}, {load}")
    bad = {n: t["errors"] for n, t in result["targets"].items() if t["errors"]}
    if bad:
        sys.stderr.write(f"errors: {bad}\n")
    return 1 if any(t["requests"] == 0 for t in result["targets"].values()) else 0
