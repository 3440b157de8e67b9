"""Resident memory of a cache on a milvus-lite file while stores stream in past its bound.

Starts a real `hopline serve cache` on a fresh file with `HOPLINE_CACHE_MAX_TOTAL_ENTRIES`,
sends exact stores over `--tenants` tenants in `StoreBatch` calls as fast as the cache takes
them (it waits while more than 4,096 are pending), and every 10,240 stores prints the cache's
entries and evictions and the resident memory of the cache process and of milvus-lite's
server (its child process); the peak of the two together at the end. What a container
holding both must allow for (docs/cache.md, "A milvus-lite file's memory").

Usage: .venv/bin/python bench/scripts/cache_file_memory.py --bound 50000 --stores 204800
       [--tenants 10] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from hopline.bench.soak import children, rss_mb
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.ports import free_ports

BATCH = 1024  # StoreBatch's most
SAMPLE_EVERY = 10 * BATCH
MAX_PENDING = 4096  # below HOPLINE_CACHE_MAX_PENDING's 10,000: no store is refused


def batch(first: int, tenants: int) -> cache_pb2.StoreBatchRequest:
    return cache_pb2.StoreBatchRequest(
        stores=[
            cache_pb2.StoreRequest(
                scope=common_pb2.Scope(
                    tenant=f"tenant-{n % tenants}", model="support-intents", model_version="1"
                ),
                text=f"customer message number {n} about an order that never arrived",
                prediction=common_pb2.Prediction(label="order_status", score=0.9),
                mode="exact",
            )
            for n in range(first, first + BATCH)
        ]
    )


def measure(bound: int, stores: int, tenants: int, work: Path) -> dict[str, Any]:
    (port,) = free_ports(1)
    env = dict(
        os.environ,
        HOPLINE_CACHE_URI=str(work / "cache.db"),
        HOPLINE_CACHE_ADDR=f"127.0.0.1:{port}",
        HOPLINE_METRICS_PORT="0",
        HOPLINE_CACHE_MAX_TOTAL_ENTRIES=str(bound),
    )
    with (work / "cache.log").open("w") as log:
        cache = subprocess.Popen(
            [sys.executable, "-m", "hopline", "serve", "cache"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    samples: list[dict[str, Any]] = []
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        stats = cache_pb2.GetStatsRequest()
        ready_by = time.monotonic() + 120
        while True:  # UNAVAILABLE until the cache is SERVING
            try:
                stub.GetStats(stats, timeout=10)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > ready_by:
                    raise
                time.sleep(0.2)
        started = time.monotonic()
        for sent in range(BATCH, stores + 1, BATCH):
            stub.StoreBatch(batch(sent - BATCH, tenants), timeout=60)
            while stub.GetStats(stats, timeout=60).pending_writes > MAX_PENDING:
                time.sleep(0.05)
            if sent % SAMPLE_EVERY == 0:
                now = stub.GetStats(stats, timeout=60)
                sample = {
                    "s": round(time.monotonic() - started, 1),
                    "stored": sent,
                    "entries": now.entries,
                    "evictions": now.evictions,
                    "cache_mib": round(rss_mb(cache.pid)),
                    "milvus_lite_mib": round(sum(rss_mb(pid) for pid, _ in children(cache.pid))),
                }
                samples.append(sample)
                print(json.dumps(sample), flush=True)
    finally:
        cache.terminate()
        cache.wait(60)
    return {
        "bound": bound,
        "stores": stores,
        "tenants": tenants,
        "peak_mib": max(s["cache_mib"] + s["milvus_lite_mib"] for s in samples),
        "reclaims": [line.strip() for line in (work / "cache.log").open() if "reclaimed" in line],
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bound", type=int, required=True)
    parser.add_argument("--stores", type=int, required=True)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hopline-file-memory-") as work:
        result = measure(args.bound, args.stores, args.tenants, Path(work))
    print("peak", result["peak_mib"], "MiB")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
