"""How long a scope invalidation holds the gateway's event loop in the key mirror
(gateway/key_mirror.py): the mirror filled with KEYS keys over 10 tenants' scopes, one
tenant's scope dropped as the watch stream delivers it, and the longest gap between two
turns of the loop seen by a ticker meanwhile (what a request waiting on that loop waits).

    .venv/bin/python bench/scripts/key_mirror_stall.py --keys 2000000
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time

from hopline.gateway.key_mirror import KeyMirror
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2


async def measure(keys: int) -> dict[str, float]:
    mirror = KeyMirror(capacity=keys + 1)
    scopes = [common_pb2.Scope(tenant=f"t{i}", model="m", model_version="1") for i in range(10)]
    for scope in scopes:
        mirror.hold(scope, (secrets.token_hex(32) for _ in range(keys // len(scopes))))
    longest = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    longest = 0.0
    started = time.perf_counter()
    mirror.apply(cache_pb2.WatchInvalidationsResponse(scope=common_pb2.Scope(tenant="t3")))
    dropped_ms = (time.perf_counter() - started) * 1e3
    left = keys - keys // len(scopes)
    for _ in range(100_000):  # polls, far more than the deletion needs
        if len(mirror) <= left:
            break
        await asyncio.sleep(0.001)
    purged_ms = (time.perf_counter() - started) * 1e3
    stop = True
    await task
    return {
        "keys": keys,
        "apply_ms": round(dropped_ms, 2),
        "until_purged_ms": round(purged_ms, 1),
        "longest_loop_gap_ms": round(longest * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        print(asyncio.run(measure(args.keys)))


if __name__ == "__main__":
    main()
