"""What p99/p50 an ideal batcher reaches at open-loop load, given this machine's model runs.

`make bench`'s open-loop target asks for p99 <= 3 x p50 at 70% of the closed-loop
saturation at 32 callers. This script tells how much of that ratio the queue itself makes,
before any hop, thread hand-off or noise: it times the model's one-thread (narrow) session
for each batch size with one run on every core at once (as runs go under load), then
simulates a batcher with no overhead at all: one run slot per core, first come first served,
a free slot taking up to `cap` waiting rows at once and never waiting for more. For each cap
it finds the simulated saturation at 32 closed-loop callers and then feeds Poisson arrivals
at the given fractions of it.

Usage: .venv/bin/python bench/scripts/open_loop_floor.py [--model support-intents]
       [--caps 2,4,8,12] [--loads 0.5,0.7] [--runs 100] [--seconds 600]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from hopline.bench.mixes import make_mix
from hopline.model.repository import ModelRepository
from hopline.model.run_width import cores
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.services.inference.backend import OnnxRuntimeBackend

ROOT = Path(__file__).resolve().parents[2]
CALLERS = 32
Feed = dict[str, np.ndarray]


def run_costs_ms(repo: Path, model: str, most: int, runs: int) -> list[float]:
    """Median milliseconds of a narrow run of 1..`most` rows, every core running one."""
    config = ModelRepository(repo).resolve(model, "")
    tokenizer = load_tokenizer(config.file("tokenizer"), config.max_sequence_length)
    mix = make_mix("miss")
    slots = cores()
    sessions = [OnnxRuntimeBackend(config, 1) for _ in range(slots)]
    costs = []
    for rows in range(1, most + 1):
        feeds = []
        for n in range(runs):  # the mix's texts in turn: a batch is as long as its longest
            batch = encode(tokenizer, [mix.text(n * rows + i) for i in range(rows)])
            feeds.append({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
        times: list[float] = []

        def runner(index: int, feeds: list[Feed] = feeds, out: list[float] = times) -> None:
            for feed in feeds[:3]:  # the first runs of a shape warm its buffers
                sessions[index].run(feed, ["logits"])
            for feed in feeds[index:] + feeds[:index]:
                started = time.perf_counter()
                sessions[index].run(feed, ["logits"])
                out.append(time.perf_counter() - started)

        threads = [threading.Thread(target=runner, args=(i,)) for i in range(slots)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        costs.append(statistics.median(times) * 1000)
    return costs


def simulate(
    costs_ms: list[float], slots: int, cap: int, *, rps: float = 0.0, seconds: float, seed: int
) -> tuple[float, float, float]:
    """Requests a second answered, p50 and p99 ms: Poisson arrivals at `rps`, or (rps 0)
    CALLERS closed-loop callers that send again the moment they are answered."""
    rnd = random.Random(seed)
    waiting: list[float] = [0.0] * (0 if rps else CALLERS)  # arrival times, oldest first
    events: list[tuple[float, int, list[float]]] = []  # (when, 0 arrival | 1 run end, rows)
    free, now, latencies = slots, 0.0, []
    if rps:
        heapq.heappush(events, (rnd.expovariate(rps), 0, []))
    while True:
        while free and waiting:
            rows, waiting = waiting[:cap], waiting[cap:]
            free -= 1
            heapq.heappush(events, (now + costs_ms[len(rows) - 1] / 1000, 1, rows))
        now, kind, rows = heapq.heappop(events)
        if now > seconds:
            break
        if kind == 0:
            waiting.append(now)
            heapq.heappush(events, (now + rnd.expovariate(rps), 0, []))
            continue
        free += 1
        latencies += [now - arrived for arrived in rows]
        if not rps:
            waiting += [now] * len(rows)
    kept = np.array(latencies[len(latencies) // 10 :]) * 1000  # past the start-up
    return len(latencies) / now, float(np.percentile(kept, 50)), float(np.percentile(kept, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--model", default="support-intents")
    parser.add_argument("--caps", default="2,4,8,12")
    parser.add_argument("--loads", default="0.5,0.7")
    parser.add_argument("--runs", type=int, default=100, help="timed runs per batch size")
    parser.add_argument("--seconds", type=float, default=600.0, help="simulated time")
    args = parser.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    slots = cores()
    costs = run_costs_ms(args.model_repo, args.model, max(caps), args.runs)
    print(
        f"{slots} slots; a run of 1..{max(caps)} rows, ms: " + ", ".join(f"{c:.2f}" for c in costs)
    )
    for cap in caps:
        saturation = simulate(costs, slots, cap, seconds=args.seconds, seed=1)[0]
        for load in (float(x) for x in args.loads.split(",")):
            rps, p50, p99 = simulate(
                costs, slots, cap, rps=load * saturation, seconds=args.seconds, seed=2
            )
            print(
                f"cap {cap:2}: saturation {saturation:6.1f} rps; at {load:.0%} ({rps:6.1f} rps) "
                f"p50 {p50:6.2f} ms, p99 {p99:6.2f} ms, p99/p50 {p99 / p50:4.2f}"
            )


if __name__ == "__main__":
    main()
