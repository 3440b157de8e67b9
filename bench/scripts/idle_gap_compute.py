"""How long a model run takes after the model has sat unused for a while.

The in-process baseline of `hopline bench` runs the model back to back: at concurrency 1 the
next run starts a tenth of a millisecond after the last. In a mesh the model waits for the
rest of the request between two runs (the client's round trip, tokenizing, postprocessing:
about 1.6 ms co-located and 7 ms through five processes at c=1 on the Xeon VM), so its compute
hop is timed on a model that has been idle. This script times the same batch-1 run after gaps
of each length, the gap spent three ways:

- sleep: the calling thread sleeps (its core may idle, as a mesh's inference thread does);
- busy: the calling thread spins in Python for the gap (its core never idles), which tells
  a slower wake-up of an idle core apart from state the model lost meanwhile (its weights,
  87 MB in FP32, falling out of the shared last-level cache as other work on the host runs);
- stream: the calling thread copies 64 MB over and over for the gap, pushing the weights out
  of the cache on purpose: what a run from memory costs.

Each session the inference service keeps for a version is timed (`wide`: every core, the
service's spin setting, what a lone request runs on; `narrow`: one thread, what a run beside
another gets), all configurations taking turns round by round.

Usage: .venv/bin/python bench/scripts/idle_gap_compute.py [--model support-intents]
       [--gaps-ms 0,0.2,1,3,7] [--rounds 3] [--runs 150] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hopline.bench.mixes import make_mix
from hopline.model.repository import ModelRepository
from hopline.model.spin import Spin
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.services.inference.backend import OnnxRuntimeBackend

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("sleep", "busy", "stream")
# Larger than this machine's share of a shared last-level cache is likely to be, small enough
# to copy in well under a millisecond a pass on these cores.
STREAM_BYTES = 64 << 20
_source = np.ones(STREAM_BYTES // 8)
_sink = np.empty_like(_source)


def spend(way: str, seconds: float) -> None:
    if way == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if way == "stream":
            np.copyto(_sink, _source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--model", default="support-intents")
    parser.add_argument("--version", default="")
    parser.add_argument("--gaps-ms", default="0,0.2,1,3,7")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=150, help="timed runs per configuration")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = ModelRepository(args.model_repo).resolve(args.model, args.version)
    sessions = {
        "wide": OnnxRuntimeBackend(config, 0, spin=Spin.RUN),
        "narrow": OnnxRuntimeBackend(config, 1),
    }
    tokenizer = load_tokenizer(config.file("tokenizer"), config.max_sequence_length)
    mix = make_mix("miss")
    feeds = []
    for i in range(64):
        batch = encode(tokenizer, [mix.text(i)])
        feeds.append({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
    for session in sessions.values():
        for feed in feeds:
            session.run(feed, ["logits"])
    gaps = [float(g) / 1000 for g in args.gaps_ms.split(",")]
    configs = [(s, w, g) for s in sessions for g in gaps for w in WAYS if g > 0 or w == WAYS[0]]
    medians: dict[tuple[str, str, float], list[float]] = {c: [] for c in configs}
    for round_no in range(args.rounds):
        for name, way, gap in configs if round_no % 2 == 0 else configs[::-1]:
            times = []
            for i in range(args.runs):
                spend(way, gap)
                started = time.perf_counter()
                sessions[name].run(feeds[i % len(feeds)], ["logits"])
                times.append(time.perf_counter() - started)
            medians[(name, way, gap)].append(statistics.median(times) * 1000)
    rows: list[dict[str, Any]] = []
    print("session  gap ms  gap spent  run p50 ms (median of rounds)  over no gap  rounds")
    for name, way, gap in configs:
        p50 = statistics.median(medians[(name, way, gap)])
        base = statistics.median(medians[(name, WAYS[0], 0.0)])
        rounds = ", ".join(f"{m:.2f}" for m in medians[(name, way, gap)])
        shown = way if gap else "-"
        print(f"{name:7}  {gap * 1000:6g}  {shown:9}  {p50:8.3f}  {p50 / base:11.2f}x  {rounds}")
        rows.append(
            {
                "session": name,
                "gap_ms": gap * 1000,
                "spent": way,
                "run_p50_ms": p50,
                "over_no_gap": p50 / base,
                "round_p50s_ms": medians[(name, way, gap)],
            }
        )
    if args.json:
        args.json.write_text(json.dumps({"model": config.key, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
