"""What a cache lookup costs on a Milvus server, read Strong or Bounded (cache/tombstones.py).

A Milvus standalone (PyPI `milvus`, `make milvus-standalone`) at the time tick given (its
default, 200 ms, unless told), and two real CacheServices in this process over it, alike but
for HOPLINE_CACHE_LOOKUP_CONSISTENCY. Both run without the in-memory exact index, so every
exact lookup reads Milvus by key, as an index miss does when several replicas share a server;
semantic lookups embed and search. After `--entries` stores have landed, blocks of lookups
alternate between the two services (exact repeats, then semantic paraphrases), so drift on a
shared machine hits both alike. Reported per variant: p50 and p99 of the Lookup RPC, the
Milvus read inside it, and how many took longer than the gateway's default 40 ms budget
(those would fail open: answered by the model, uncached).

Usage: .venv/bin/python bench/scripts/server_lookups.py [--tick-ms 200] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's Milvus server launcher

from cache_service import cache, lookup, store, written  # noqa: E402
from milvus_server import MilvusKind, MilvusServer, _standalone_command  # noqa: E402

from hopline.cache.store import LookupConsistency  # noqa: E402

BUDGET_MS = 40.0  # the gateway's default HOPLINE_CACHE_BUDGET_MS


def standalone_at(tick_ms: int) -> Any:
    """The test launcher's standalone command with `proxy.timeTickInterval` set to tick_ms."""

    def command(data: Path, port: int) -> tuple[list[str], dict[str, str]]:
        args, env = _standalone_command(data, port)
        return [a.replace("timeTickInterval=20", f"timeTickInterval={tick_ms}") for a in args], env

    return command


async def measure(uri: str, args: argparse.Namespace) -> None:
    samples: dict[tuple[LookupConsistency, str], list[tuple[float, float]]] = {}
    texts = [f"where is my parcel number {i}" for i in range(args.entries)]
    async with contextlib.AsyncExitStack() as stack:
        stubs = {}
        for level in (LookupConsistency.STRONG, LookupConsistency.BOUNDED):
            _, stubs[level] = await stack.enter_async_context(
                cache(
                    uri,
                    exact_index=False,
                    lookup_consistency=level,
                    verify_state=str(Path(args.work) / f"{level.value}.sqlite"),
                )
            )
        strong = stubs[LookupConsistency.STRONG]
        for text in texts:
            await store(strong, text, mode="semantic")
        await written(strong)
        for round_ in range(args.rounds):
            order = list(stubs.items()) if round_ % 2 == 0 else list(stubs.items())[::-1]
            for level, stub in order:
                for kind, query in (("exact", "{}"), ("semantic", "please, {}?")):
                    for text in texts[: args.block]:
                        started = time.perf_counter()
                        reply = await lookup(
                            stub, query.format(text), mode="semantic", threshold=0.8
                        )
                        total = (time.perf_counter() - started) * 1e3
                        read = reply.exact_ms if kind == "exact" else reply.search_ms
                        samples.setdefault((level, kind), []).append((total, read))
    print(f"Milvus standalone, proxy.timeTickInterval={args.tick_ms} ms")
    print("| lookups | consistency | n | RPC p50 / p99 ms | Milvus read p50 / p99 ms | > 40 ms |")
    print("|---|---|---|---|---|---|")
    for (level, kind), values in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        totals, reads = (np.array(v) for v in zip(*values, strict=True))
        over = int((totals > BUDGET_MS).sum())
        print(
            f"| {kind} | {level.value} | {len(totals)} | {np.median(totals):.1f} / "
            f"{np.percentile(totals, 99):.1f} | {np.median(reads):.1f} / "
            f"{np.percentile(reads, 99):.1f} | {over} ({100 * over / len(totals):.0f}%) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tick-ms", type=int, default=200)
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=20, help="lookups of a kind per turn")
    args = parser.parse_args()
    import milvus_server

    milvus_server._standalone_command = standalone_at(args.tick_ms)
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        server = MilvusServer(Path(work) / "milvus", MilvusKind.STANDALONE).start()
        try:
            asyncio.run(measure(server.uri, args))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
