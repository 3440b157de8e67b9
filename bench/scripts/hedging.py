"""Would hedging the inference hop cut its p99? Measured before building it into the gateway.

gRPC's own hedgingPolicy is not implemented by grpc core (grpcio): a service config with one
is accepted and ignored (checked: a 50 ms hedging delay in front of a replica that answers in
500 ms still waited 500 ms, one attempt per call). So this measures what a gateway-side hedge
would buy: two inference replicas behind one round_robin channel, as the gateway dials them,
the same open-loop Poisson arrivals sent either plainly or hedged (if the first attempt has
not answered after `delay`, a second goes to the next replica and the first answer wins; the
other is cancelled). The delay is the plain run's p90 (at most about one call in ten is doubled).
Rounds alternate plain and hedged in ABBA order. Reported: p50, p99 and the share of calls
hedged, per variant (medians over rounds).

Not built into the gateway: a gateway-side hedge (through the whole mesh, stage batching on,
HOPLINE_INFERENCE_HEDGE_PERCENTILE=90, two replicas, 30 rps, 4 ABBA rounds of 20 s on a shared
2-core machine) sent 48 hedges (2%), 5 of which answered first, and did not cut the p99
(median 805 ms hedged vs 588 ms plain, rounds spread 100 ms to 2.7 s); measured directly on
Infer the p99 halved (502 -> 263 ms) at 3% extra calls. Run it again on a quiet machine
with several replicas before building it in.

Usage: .venv/bin/python bench/scripts/hedging.py [--rps 40] [--duration 30] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from hopline.bench.load import percentiles_ms
from hopline.bench.mixes import make_mix
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.launcher import Mesh, is_serving
from hopline.runtime.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
MODEL = "support-intents"


async def requests(tokenizer: str, count: int) -> list[inference_pb2.InferRequest]:
    mix = make_mix("miss")
    out = []
    async with grpc.aio.insecure_channel(tokenizer) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for i in range(count):
            t = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(model=MODEL, texts=[mix.text(i)]))
            out.append(
                inference_pb2.InferRequest(
                    model=MODEL, inputs=[t.input_ids, t.attention_mask], outputs=["logits"]
                )
            )
    return out


async def run(
    stub: inference_pb2_grpc.InferenceServiceStub,
    reqs: list[inference_pb2.InferRequest],
    rps: float,
    seconds: float,
    delay_s: float | None,
    seed: int,
) -> tuple[list[int], int]:
    """Latencies (ns, from scheduled arrival) and how many calls were hedged."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rps, int(rps * seconds * 1.5) + 8))
    arrivals = arrivals[arrivals < seconds]
    latencies: list[int] = []
    hedged = 0

    async def one(i: int, due: int) -> None:
        nonlocal hedged
        req = reqs[i % len(reqs)]
        first = asyncio.ensure_future(stub.Infer(req, timeout=10))
        if delay_s is not None:
            done, _ = await asyncio.wait({first}, timeout=delay_s)
            if not done:
                hedged += 1
                second = asyncio.ensure_future(stub.Infer(req, timeout=10))
                done, pending = await asyncio.wait(
                    {first, second}, return_when=asyncio.FIRST_COMPLETED
                )
                for p in pending:
                    p.cancel()
                await next(iter(done))
                latencies.append(time.perf_counter_ns() - due)
                return
        await first
        latencies.append(time.perf_counter_ns() - due)

    tasks = []
    start = time.perf_counter_ns()
    for i, at in enumerate(arrivals):
        due = start + int(at * 1e9)
        wait = due - time.perf_counter_ns()
        if wait > 0:
            await asyncio.sleep(wait / 1e9)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    return latencies, hedged


async def measure(target: str, tokenizer: str, args: argparse.Namespace) -> None:
    reqs = await requests(tokenizer, 200)
    options = [("grpc.lb_policy_name", "round_robin")]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        await run(stub, reqs, args.rps, 5, None, 99)  # warm both replicas
        base, _ = await run(stub, reqs, args.rps, args.duration, None, 100)
        delay_s = percentiles_ms(base)["p90_ms"] / 1e3
        print(f"hedging delay (plain p90): {delay_s * 1e3:.2f} ms", flush=True)
        results: dict[str, list[dict[str, float]]] = {"plain": [], "hedged": []}
        for r in range(args.rounds):
            order = ("plain", "hedged") if r % 2 == 0 else ("hedged", "plain")
            for name in order:
                lat, hedged = await run(
                    stub, reqs, args.rps, args.duration, delay_s if name == "hedged" else None, r
                )
                p = percentiles_ms(lat)
                results[name].append({**p, "hedged_share": hedged / max(1, len(lat))})
                print(
                    f"round {r} {name:<6} p50 {p['p50_ms']:.2f} p99 {p['p99_ms']:.2f} ms "
                    f"n={len(lat)} hedged {hedged}",
                    flush=True,
                )
        for name, rows in results.items():
            p50 = statistics.median(x["p50_ms"] for x in rows)
            p99 = statistics.median(x["p99_ms"] for x in rows)
            share = statistics.median(x["hedged_share"] for x in rows)
            print(f"median {name:<6} p50 {p50:.2f} ms  p99 {p99:.2f} ms  hedged {share:.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rps", type=float, default=40.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-hedging-"))
    second = free_ports(1)[0]
    quiet = {"HOPLINE_LOG_LEVEL": "warning", "HOPLINE_INFERENCE_THREADS": "1"}
    mesh = Mesh.on_free_ports(args.model_repo, work, env=quiet)
    extra = {
        **mesh.env,
        "HOPLINE_INFERENCE_ADDR": f"127.0.0.1:{second}",
        "HOPLINE_METRICS_PORT": "0",
    }
    with (work / "inference-2.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hopline", "serve", "inference"],
            env=extra,
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 180
        while not is_serving(f"127.0.0.1:{second}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the second inference replica did not start")
            time.sleep(0.2)
        mesh.start(("tokenizer", "inference"), timeout_s=180)
        replicas = f"ipv4:{mesh.addrs['inference']},127.0.0.1:{second}"
        asyncio.run(measure(replicas, mesh.addrs["tokenizer"], args))
    finally:
        mesh.stop()
        proc.terminate()
        proc.wait(timeout=15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
