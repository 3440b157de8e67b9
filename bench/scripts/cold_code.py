"""How much slower a request's small steps run when they have not run for a while.

At concurrency 1 every hop of a mesh finds its code idle: the model's run (milliseconds) comes
between one request's tokenize and the next one's. On some machines (the shared 2-core VM of
this project's stops) code that has not run for a few milliseconds runs several times slower
the next time, with no thread to wake: caches and predictors were taken by other work. This
measures it for three steps of a miss, each back to back and after a gap of the given lengths
(filled by spinning or by sleeping, which behave alike where the cause is the machine):

- the default model's tokenizer encoding one text (HF `tokenizers`, Rust);
- the tokenizer service's reply built from that (numpy arrays into a protobuf message);
- the tokenizer called in-process through its stub, as a co-located gateway calls it (the
  server wrappers, `gateway/upstream.py:call_hop`'s span and timing).

Usage: .venv/bin/python bench/scripts/cold_code.py [--gaps-ms 0,1,2,5,10] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc

from hopline.gateway.upstream import call_hop
from hopline.model.repository import ModelRepository
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.inproc import InProcessService
from hopline.runtime.service_table import spec
from hopline.runtime.tensors import to_tensor

MODEL = "support-intents"
TEXT = "I forgot my password again"


def _gap(seconds: float, sleep: bool) -> None:
    if sleep:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _median_us(step: Callable[[], object], gap_s: float, sleep: bool, calls: int) -> float:
    times = []
    for _ in range(calls):
        _gap(gap_s, sleep)
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


async def _hop_us(gap_s: float, sleep: bool, calls: int) -> float:
    service = InProcessService.load(spec("tokenizer"))
    await service.start()
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(cast(grpc.aio.Channel, service.channel))
    request = tokenizer_pb2.TokenizeRequest(model=MODEL, texts=[TEXT])
    timings: dict[str, float] = {}
    times = []
    for _ in range(calls):
        _gap(gap_s, sleep)
        started = time.perf_counter()
        await call_hop("tokenize", "inproc", stub.Tokenize, request, 5.0, timings)
        times.append((time.perf_counter() - started) * 1e6)
    await service.stop()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repo", type=Path, default=Path("models"))
    parser.add_argument("--gaps-ms", default="0,1,2,5,10")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("HOPLINE_MODEL_REPO", str(args.model_repo))
    config = ModelRepository(args.model_repo).resolve(MODEL, "")
    tokenizer = load_tokenizer(config.file("tokenizer"), config.max_sequence_length)
    batch = encode(tokenizer, [TEXT])

    def reply() -> object:
        return tokenizer_pb2.TokenizeResponse(
            input_ids=to_tensor("input_ids", batch.input_ids),
            attention_mask=to_tensor("attention_mask", batch.attention_mask),
            lengths=batch.lengths,
        )

    steps: dict[str, Callable[[float, bool], float]] = {
        "tokenizer encode": lambda g, s: _median_us(
            lambda: tokenizer.encode(TEXT), g, s, args.calls
        ),
        "reply message": lambda g, s: _median_us(reply, g, s, args.calls),
        "in-process tokenize hop": lambda g, s: asyncio.run(_hop_us(g, s, args.calls)),
    }
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    print("median us per call, after a gap of (ms):", ", ".join(f"{g * 1e3:g}" for g in gaps))
    for name, measure in steps.items():
        for sleep in (False, True):
            row = [measure(g, sleep) for g in gaps]
            how = "sleeping" if sleep else "spinning"
            print(f"{name:24s} {how:9s}", "  ".join(f"{us:8.1f}" for us in row))


if __name__ == "__main__":
    main()
