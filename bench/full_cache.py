"""Misses through a mesh whose cache is full against one whose cache is empty (`make bench`'s
`full_cache_c32`).

The miss mix stores nearly every answer, so a cache in service fills to its model's
`max_entries` and from then on every store evicts: that, not the empty cache of a mesh just
started, is the steady state the other scenarios' meshes never reach in their windows. Until
stop 58 the eviction counted and scanned the scope's rows in Milvus after every batched
write, and a full cache cost a co-located mesh a fifth of its throughput at 32 callers
(cache/entry_bounds.py); this scenario keeps such a cost in sight.

Two co-located meshes over the same repository; the `full` one's cache is filled through
StoreBatch to the default model's bound (in the gateway's default tenant, so the
benchmark's own stores evict from it) before `hopline bench --concurrency 32 --mix miss`
measures both, target and peer, in alternated rounds. Each cache's evictions are read after
the windows, so a run in which the full cache did not evict cannot pass for one that did.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from hopline.bench.cli import bench_once
from hopline.bench.shared_embedding import colocated_meshes, paired_windows
from hopline.cache.keys import answer_parameters
from hopline.cache.service import STORE_BATCH_MAX
from hopline.gateway.identity import DEFAULT_TENANT
from hopline.model.repository import ModelRepository, version_digest
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2

MODEL = "support-intents"
FULL, EMPTY = "full", "empty"
KEY = "full_cache_c32"
LIMIT = 0.9  # of the empty cache's throughput
FILL_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 60.0


def fill(cache_addr: str, entries: int, version: str, digest: str) -> int:
    """Store `entries` new answers in the gateway's default tenant; the cache's count after
    every one of them reached Milvus."""
    scope = common_pb2.Scope(
        tenant=DEFAULT_TENANT,
        model=MODEL,
        model_version=version,
        parameters=answer_parameters(1, digest),
    )
    answer = common_pb2.Prediction(label="prefill", score=1.0)
    deadline = time.monotonic() + FILL_TIMEOUT_S
    with grpc.insecure_channel(cache_addr) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)

        def pending() -> int:
            stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
            if time.monotonic() > deadline:
                raise SystemExit(f"the cache at {cache_addr} took over {FILL_TIMEOUT_S:g} s")
            return int(stats.pending_writes)

        for start in range(0, entries, STORE_BATCH_MAX):
            stores = [
                cache_pb2.StoreRequest(
                    scope=scope, text=f"prefilled question {i}", prediction=answer, mode="exact"
                )
                for i in range(start, min(entries, start + STORE_BATCH_MAX))
            ]
            reply = stub.StoreBatch(
                cache_pb2.StoreBatchRequest(stores=stores), timeout=CALL_TIMEOUT_S
            )
            if refused := [r.message for r in reply.results if r.code]:
                raise SystemExit(f"the cache refused the prefill: {refused[0]}")
            while pending() > 2 * STORE_BATCH_MAX:  # the cache holds 10,000 at most
                time.sleep(0.05)
        while pending():
            time.sleep(0.05)
        return int(stub.GetStats(cache_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S).entries)


def evictions(cache_addr: str) -> int:
    with grpc.insecure_channel(cache_addr) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        return int(stub.GetStats(cache_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S).evictions)


def full_cache_scenario(
    model_repo: Path,
    work: Path,
    *,
    rounds: int = 3,
    duration_s: float = 24.0,
    warmup_s: float = 2.0,
    bound: int | None = None,
) -> dict[str, Any]:
    """`bound` (HOPLINE_CACHE_MAX_ENTRIES for both meshes) below the model's own makes a
    short run for tests; `make bench` keeps the model's."""
    work.mkdir(parents=True, exist_ok=True)
    model = ModelRepository(model_repo).resolve(MODEL)
    entries = min(bound or model.cache.max_entries, model.cache.max_entries)
    env = {"HOPLINE_CACHE_MAX_ENTRIES": str(bound)} if bound else {}
    with colocated_meshes(model_repo, work, {FULL: env, EMPTY: env}) as meshes:
        digest = version_digest(model.path)  # the scope the gateway stores its answers in
        filled = fill(meshes[FULL].addrs["cache"], entries, model.version, digest)
        windows = paired_windows(
            meshes[FULL], (EMPTY, meshes[EMPTY]), model_repo, rounds, duration_s, warmup_s
        )
        result = bench_once(*windows, "--concurrency", "32", "--baseline", "none")
        result["cache"] = {
            "bound": entries,
            "prefilled": filled,
            "evictions": {name: evictions(m.addrs["cache"]) for name, m in meshes.items()},
        }
    return {KEY: result}


def full_cache_targets(sc: dict[str, Any]) -> list[dict[str, Any]]:
    """The suite's row: the full cache's c=32 throughput within LIMIT of the empty one's, and
    only when it really was full and evicting."""
    if KEY not in sc:
        return []
    t, cache = sc[KEY]["targets"], sc[KEY]["cache"]
    full, empty = t["mesh"], t[f"peer_{EMPTY}"]
    value = full["throughput_rps"] / empty["throughput_rps"]
    evicting = cache["prefilled"] >= cache["bound"] and cache["evictions"][FULL] > 0
    how = (
        f"ratio ({full['throughput_rps']:.1f} vs {empty['throughput_rps']:.1f} rps, p99 "
        f"{full['p99_ms']:.1f} vs {empty['p99_ms']:.1f} ms; {cache['prefilled']} entries "
        f"prefilled, bound {cache['bound']}, {cache['evictions'][FULL]} evicted)"
    )
    return [
        {
            "target": f"{KEY}: misses with the cache full vs empty, co-located, rps",
            "value": value,
            "limit": LIMIT,
            "met": value >= LIMIT and evicting,
            "how": how if evicting else f"{how}; THE FULL CACHE DID NOT EVICT",
        }
    ]
