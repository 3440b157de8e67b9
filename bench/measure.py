"""One target's measured window in `hopline bench`: its cache filled first where the mix
repeats texts, its payloads built before the window, then the closed or open loop
(bench/load.py)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from collections.abc import Callable
from typing import Any

import grpc

from hopline.bench.load import BlockingCall, Run, closed_loop, open_loop
from hopline.bench.mixes import Mix, narrowed
from hopline.bench.targets import Target


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


class PrimeError(Exception):
    """A target refused the requests that fill its cache: nothing of it can be measured."""

    def __init__(self, target: str, err: grpc.RpcError) -> None:
        self.code: grpc.StatusCode = err.code()
        said = f"{self.code.name}: {err.details()}"
        super().__init__(f"{target} refused the cache-filling requests: {said}")


async def prime(target: Target, mix: Mix, blocking: BlockingCall | None = None) -> Mix:
    """Fill the cache with the mix's primed texts, then send each again: a repeat that is not
    a hit is a text the model's cache policy does not keep (an out-of-scope answer, a score
    below min_score). It is left out, and said, so a window of repeats holds only repeats.
    With `blocking`, through it (the window's call: no grpc.aio channel is opened)."""

    async def send(text: str) -> Any:
        try:
            if blocking is not None:
                return await asyncio.to_thread(blocking, target.payload(text))
            return await target.call(target.payload(text))
        except grpc.RpcError as err:
            raise PrimeError(target.name, err) from err

    for text in mix.prime:
        await send(text)
    kept = []
    for text in mix.prime:
        outcome, _ = target.describe(await send(text))
        # Only a MISS says the cache looked and did not have it. A target without a cache
        # (echo, a peer: no outcome) or a lookup that failed open says nothing of the policy.
        if outcome != "miss":
            kept.append(text)
    if len(kept) == len(mix.prime):
        return mix
    sys.stderr.write(
        f"{target.name}: {len(mix.prime) - len(kept)} of {len(mix.prime)} primed texts are not "
        f"kept by the cache (the model's cache policy); the {mix.name} mix leaves them out\n"
    )
    return narrowed(mix, kept)


async def measure(
    target: Target,
    mix: Mix,
    args: argparse.Namespace,
    pause_s: float = 0.0,
    at_window: Callable[[], None] | None = None,
) -> Run:
    concurrency = args.concurrency or 1
    # One caller of a gRPC target blocks on a thread of its own (bench/load.py says why).
    blocking = None if args.rps or concurrency > 1 else target.blocking()
    if blocking is not None:
        # Frees grpc.aio channels that earlier windows dropped, so that gRPC's aio poller
        # thread has stopped before this one (bench/targets.py: PredictTarget).
        gc.collect()
    mix = await prime(target, mix, blocking)  # exact and semantic mixes: fill the cache first
    seconds = args.duration + args.warmup
    expected = args.rps * seconds if args.rps else concurrency * 300 * seconds
    payloads = _Payloads(target, mix, int(expected * 1.3) + 1000)
    if args.rps:
        return await open_loop(
            target.call,
            payloads,
            rps=args.rps,
            duration_s=args.duration,
            warmup_s=args.warmup,
            at_window=at_window,
        )
    return await closed_loop(
        target.call,
        payloads,
        concurrency=concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        pause_s=pause_s,
        at_window=at_window,
        blocking=blocking,
    )
