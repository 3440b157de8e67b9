"""CPU a cache store costs the gateway's event loop (gateway/store_queue.py), store by store.

A miss's answer is stored after its reply, on the same loop that runs the next requests and
beside the model's threads, so what a store costs there is taken from both. This drives the
gateway's own `CacheWrites` over a stand-in cache (a StoreBatch that answers after 2 ms, as
the real one roughly does for a window's rows) with stores in bursts of 20 between loop turns
(as requests' other steps interleave), the default linger shortened to 50 ms, tracing off
(`make run`'s default), and prints the process CPU per store over 7 rounds of 2000 stores.

Measured on stop 45 (Intel Xeon, 2 vCPUs; medians of 7): 9.3 and 10.5 us a store, against
95.9 and 142.4 us for the path before it (a task, a traced hop call and a queued future per
store through gateway/stage_batching.py), run the same way from the commit before.

Usage: .venv/bin/python bench/scripts/store_cost.py [--stores 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import types
from typing import Any

from hopline.gateway.cache_writes import CacheWrites
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

LINGER_S = 0.05
BURST = 20


class _Stub:
    async def StoreBatch(self, request: Any, **_: Any) -> cache_pb2.StoreBatchResponse:
        await asyncio.sleep(0.002)
        return cache_pb2.StoreBatchResponse(
            results=[cache_pb2.StoreResult() for _ in request.stores]
        )


class _Pool:
    target = "cache:8023"

    def stub(self) -> _Stub:
        return _Stub()


async def _rounds(stores: int, rounds: int) -> list[float]:
    writes = CacheWrites(_Pool(), batched=True, linger_s=LINGER_S)  # type: ignore[arg-type]
    policy = types.SimpleNamespace(ttl_s=3600, max_entries=1000, mode="exact")
    scope = common_pb2.Scope(tenant="t", model="m", model_version="1")
    calls = [
        types.SimpleNamespace(info=types.SimpleNamespace(cache=policy), scope=scope, text=f"t{i}")
        for i in range(stores)
    ]
    prediction = common_pb2.Prediction(label="reset_password", score=0.9)
    per_store_us = []
    for _ in range(rounds):
        started = time.process_time()
        for i, call in enumerate(calls):
            writes.store(call, prediction)  # type: ignore[arg-type]
            if i % BURST == BURST - 1:
                await asyncio.sleep(0)
        await asyncio.sleep(LINGER_S + 0.01)
        while writes.tasks:
            await asyncio.gather(*list(writes.tasks))
        per_store_us.append((time.process_time() - started) / stores * 1e6)
    return per_store_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stores", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    figures = asyncio.run(_rounds(args.stores, args.rounds))
    shown = ", ".join(f"{x:.1f}" for x in figures)
    print(f"us of CPU per store: {shown}; median {statistics.median(figures):.1f}")


if __name__ == "__main__":
    main()
