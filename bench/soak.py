"""`make soak`: a long open-loop run against a fresh mesh, reported minute by minute.

    python -m hopline.bench.soak [--duration 1800] [--rps R] [--json out.json]

Starts the five services on free ports (the same launcher as `make run`), measures what the
mesh can take (a short closed loop: `--probe-s` seconds at `--probe-concurrency` callers)
and then sends Poisson arrivals at 70% of that (or `--rps`) for `--duration` seconds. Every
minute (`--interval`) it prints and records: requests, errors by status, p50 and p99, the
resident memory of each service's process, and the cache's entries and evictions. At the end:
the totals, the worst minute's p99, and RSS growth per service after the warm-up (its peak and
its trough in the first third of the minutes against the last third: `rss_growth`), against the
targets (0 errors; growth under 10%). Exit code 1 when a target is missed.

The cache is bounded (`--max-entries`, HOPLINE_CACHE_MAX_ENTRIES). A miss mix stores a new
entry with nearly every request (about 4,500 a minute here), so an unbounded cache grows by design
until its TTL starts expiring entries an hour in: memory that grows then is data, and a soak
that cannot tell data from a leak proves nothing. Full, every store evicts one entry. Child
processes are measured too: the cache's milvus-lite server is one, and it keeps every deleted
row in memory until the cache reclaims them (a copy of the live rows to a fresh collection,
once the deleted rows reach the live ones; docs/cache.md). So the warm-up lasts until the
first reclaim (or, when there is none, the first eviction), at least one minute, and growth
from there on is what the mesh keeps that it should not.

Not in `make test` (30 minutes); `make soak SOAK_DURATION=180` runs a short one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc

from hopline.bench.load import closed_loop, open_loop, percentiles_ms
from hopline.bench.mixes import make_mix
from hopline.bench.targets import PredictTarget
from hopline.cli.outputs import output_problem
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.launcher import Mesh
from hopline.runtime.tls import aio_channel, operator_tls

LOAD_SHARE = 0.7  # of the measured capacity
RSS_GROWTH_TARGET = 0.10
RSS_SAMPLE_S = 2.0
MAX_ENTRIES = 20_000  # filled in about 3 minutes at this machine's 70% of a miss mix


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of the processes `pid` started (empty when it is gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if int(rest.split()[1]) == pid:
            found.append((int(entry.name), comm))
    return found


def service_rss(procs: dict[str, int]) -> dict[str, float]:
    """Each service's RSS, and each of its children's as `service/command`: the cache's
    milvus-lite runs as a child process (its `milvus` server), whose memory is the cache's
    too and would be missed by the service's own figure."""
    rss = {}
    for name, pid in procs.items():
        rss[name] = round(rss_mb(pid), 1)
        for child, comm in children(pid):
            rss[f"{name}/{comm}"] = round(rss_mb(child), 1)
    return rss


@dataclasses.dataclass
class RssSpread:
    """The highest and lowest RSS of each process over one row's samples."""

    high: dict[str, float] = dataclasses.field(default_factory=dict)
    low: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, rss: dict[str, float]) -> None:
        for name, mb in rss.items():
            self.high[name] = max(mb, self.high.get(name, mb))
            self.low[name] = min(mb, self.low.get(name, mb))


async def sample_rss(pids: dict[str, int], spread: RssSpread) -> None:
    # Every few seconds, so a reclaim's copy (about 5 s of peak memory in milvus-lite) is
    # seen in the row it happens in rather than by chance at a minute's end.
    while True:
        spread.add(service_rss(pids))
        await asyncio.sleep(RSS_SAMPLE_S)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hopline.bench.soak", description=__doc__)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--interval", type=float, default=60.0, help="seconds per reported row")
    p.add_argument("--rps", type=float, help=f"arrival rate (default: {LOAD_SHARE:.0%} of probe)")
    p.add_argument("--probe-s", type=float, default=15.0, help="capacity probe length")
    p.add_argument("--probe-concurrency", type=int, default=8)
    p.add_argument("--mix", default="miss", choices=("miss", "exact", "semantic", "clinc"))
    p.add_argument("--cache", default="use", choices=("use", "bypass"))
    p.add_argument("--timeout", type=float, default=10.0, help="per-request deadline, seconds")
    p.add_argument(
        "--max-entries",
        type=int,
        default=MAX_ENTRIES,
        help="the cache's bound per (tenant, model); the warm-up lasts until it is reached",
    )
    p.add_argument(
        "--model-repo", type=Path, default=Path(os.environ.get("HOPLINE_MODEL_REPO", "models"))
    )
    p.add_argument("--json", type=Path, help="write every row and the summary here")
    return p.parse_args(argv)


async def cache_counts(mesh: Mesh) -> dict[str, int]:
    """The cache's entries, evictions and reclaims so far (empty when it does not answer)."""
    address = mesh.addrs["cache"]
    async with aio_channel(address, operator_tls("cache", mesh.env)) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        try:
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError:
            return {}
    return {"entries": stats.entries, "evictions": stats.evictions, "reclaims": stats.reclaims}


async def soak(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    target = PredictTarget(
        "mesh",
        mesh.gateway,
        cache_mode=common_pb2.CACHE_MODE_USE
        if args.cache == "use"
        else common_pb2.CACHE_MODE_BYPASS,
        timeout_s=args.timeout,
        tls=operator_tls("gateway", mesh.env),
    )
    mix = make_mix(args.mix)
    try:
        for text in mix.prime:
            await target.call(target.payload(text))
        rps = args.rps
        if rps is None:
            probe = await closed_loop(
                target.call,
                lambda i: target.payload(mix.text(i)),
                concurrency=args.probe_concurrency,
                duration_s=args.probe_s,
                warmup_s=3.0,
            )
            capacity = probe.answered / probe.duration_s
            rps = LOAD_SHARE * capacity
            sys.stdout.write(f"capacity {capacity:.1f} rps; soaking at {rps:.1f} rps\n")
        rows: list[dict[str, Any]] = []
        offset = 1 << 30  # texts after the probe's: a miss mix stays all misses
        windows = max(1, round(args.duration / args.interval))
        for minute in range(windows):
            base = offset

            def payload(i: int, base: int = base) -> bytes:
                return target.payload(mix.text(base + i))

            pids = {n: p.pid for n, p in mesh.procs.items()}
            sampler = asyncio.create_task(sample_rss(pids, spread := RssSpread()))
            try:
                run = await open_loop(
                    target.call,
                    payload,
                    rps=rps,
                    duration_s=args.interval,
                    seed=minute,
                )
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            offset += run.completed + 1
            rss = service_rss(pids)
            spread.add(rss)
            row: dict[str, Any] = {
                "minute": minute + 1,
                "requests": run.completed,
                "errors": run.errors,
                **{k: round(v, 2) for k, v in percentiles_ms(run.answered_ns).items()},
                "rss_mb": rss,
                "rss_high_mb": spread.high,
                "rss_low_mb": spread.low,
                "cache": await cache_counts(mesh),
            }
            rows.append(row)
            failed = sum(run.errors.values())
            sys.stdout.write(
                f"min {minute + 1:>3}  n {run.completed:>6}  errors {failed:>3}"
                f"  p50 {row['p50_ms']:7.2f}  p99 {row['p99_ms']:7.2f} ms  RSS MB: "
                + " ".join(f"{n} {mb:.0f}" for n, mb in rss.items())
                + "  cache "
                + " ".join(f"{k} {v}" for k, v in row["cache"].items())
                + "\n"
            )
            sys.stdout.flush()
    finally:
        await target.close()
    return summarise(rows, rps)


def warm_up_rows(rows: list[dict[str, Any]]) -> int:
    """Rows of warm-up, at least one: up to the first in which the cache reclaimed its
    milvus-lite collection, else the first in which it evicted (it was full), else one.

    Full, milvus-lite's memory rises with the deleted rows until the first reclaim frees them,
    and from then on it rises and falls between reclaims (cache/generations.py): the first
    reclaim ends the warm-up, and growth from there is what a full cycle does not give back.
    The summary says when the cache never filled or never reclaimed."""
    for counter in ("reclaims", "evictions"):
        for i, row in enumerate(rows):
            if row["cache"].get(counter, 0) > 0:
                return i + 1
    return 1


def rss_growth(after: list[dict[str, Any]]) -> dict[str, float]:
    """Per process, the larger of the growth of its peak and of its trough, from the first
    third of the minutes after the warm-up to the last third.

    milvus-lite's memory rises and falls between reclaims (150-290 MB in a soak), so two single
    minutes compare whatever phases they fell on; the peaks and the troughs of each third
    (each row's highest and lowest sample, every RSS_SAMPLE_S) compare like with like. A flat
    process gives its end against its start, and a leak raises both."""
    k = max(1, len(after) // 3)
    first, last = after[:k], after[-k:]

    def values(rows: list[dict[str, Any]], name: str, spread: str) -> list[float]:
        # A row's spread over its samples where recorded, else its one end-of-row sample.
        return [r.get(spread, r["rss_mb"]).get(name, r["rss_mb"].get(name, 0.0)) for r in rows]

    growth = {}
    for n in after[0]["rss_mb"]:
        peak = _growth(max(values(first, n, "rss_high_mb")), max(values(last, n, "rss_high_mb")))
        trough = _growth(min(values(first, n, "rss_low_mb")), min(values(last, n, "rss_low_mb")))
        growth[n] = max(peak, trough)
    return growth


def _growth(before: float, after: float) -> float:
    return (after - before) / before if before else 0.0


def summarise(rows: list[dict[str, Any]], rps: float) -> dict[str, Any]:
    errors: dict[str, int] = {}
    for row in rows:
        for status, n in row["errors"].items():
            errors[status] = errors.get(status, 0) + n
    warm_rows = warm_up_rows(rows)
    # With no row after the warm-up there is nothing to measure growth over: not met.
    measured = warm_rows < len(rows)
    warm = rows[warm_rows - 1]["rss_mb"]
    last = rows[-1]["rss_mb"]
    end_vs_warm = {n: _growth(warm[n], last.get(n, 0.0)) for n in warm}
    growth = rss_growth(rows[warm_rows - 1 :])
    return {
        "rps": round(rps, 2),
        "minutes": len(rows),
        "requests": sum(r["requests"] for r in rows),
        "errors": errors,
        "worst_minute_p99_ms": max(r["p99_ms"] for r in rows),
        "warm_up_minutes": warm_rows,
        "cache_filled": any(r["cache"].get("evictions", 0) > 0 for r in rows),
        "cache_reclaimed": any(r["cache"].get("reclaims", 0) > 0 for r in rows),
        "rss_growth_after_warm_up": {n: round(g, 4) for n, g in growth.items()} if measured else {},
        "rss_end_vs_warm_up": {n: round(g, 4) for n, g in end_vs_warm.items()} if measured else {},
        "met": measured and not errors and all(g < RSS_GROWTH_TARGET for g in growth.values()),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.json is not None and (problem := output_problem(args.json, "--json")) is not None:
        sys.stderr.write(f"hopline soak: error: {problem}\n")
        return 2
    work = Path(tempfile.mkdtemp(prefix="hopline-soak-"))
    env = {"HOPLINE_LOG_LEVEL": "warning", "HOPLINE_CACHE_MAX_ENTRIES": str(args.max_entries)}
    mesh = Mesh.on_free_ports(args.model_repo, work, env=env)
    try:
        mesh.start(timeout_s=180.0)
        result = asyncio.run(soak(mesh, args))
    finally:
        mesh.stop()
    growth = (
        ", ".join(f"{n} {g:+.1%}" for n, g in result["rss_growth_after_warm_up"].items())
        or "not measured (no minute after the warm-up: run longer)"
    )
    filled = (
        " (the cache never filled)"
        if not result["cache_filled"]
        else ""
        if result["cache_reclaimed"]
        else " (the cache never reclaimed milvus-lite's deleted rows)"
    )
    end = ", ".join(f"{n} {g:+.1%}" for n, g in result["rss_end_vs_warm_up"].items())
    sys.stdout.write(
        f"\nsoak: {result['requests']} requests at {result['rps']} rps over "
        f"{result['minutes']} min; errors {result['errors'] or 0}; worst minute p99 "
        f"{result['worst_minute_p99_ms']} ms; RSS growth after the warm-up of "
        f"{result['warm_up_minutes']} min{filled}: {growth} (last minute against the "
        f"warm-up's: {end or 'none'}); targets {'met' if result['met'] else 'MISSED'} "
        f"(logs: {work})\n"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
