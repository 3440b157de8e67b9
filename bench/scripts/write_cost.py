"""CPU a cache write costs, row by row: the cache process's and milvus-lite's.

The cache's writer lands the stores of a flush interval with one `MilvusStore.upsert` (a key
query, then an insert of the new keys), on the same two cores as a co-located mesh's model,
so what a write costs is taken from the model's runs that overlap it. This writes batches of
exact-only rows (one placeholder vector, as the cache stores them) into a fresh milvus-lite
file and prints, per row, the CPU of this process's threads and of milvus-lite's server
(by /proc schedstat, so every thread counts), median over the batches after a warm-up.

Usage: .venv/bin/python bench/scripts/write_cost.py [--batch 40] [--batches 40] [--dim 384]

Run it from two checkouts to compare a change (PYTHONPATH or the checkout's own venv).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hopline.cache.keys import exact_key
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.store import Entry, Vector

WARMUP = 5
SCOPE = ("", "support-intents", "1", "")


def task_cpu_ns(pids: list[int]) -> int:
    """Every thread's run time so far (schedstat: nanoseconds, not clock ticks)."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended
                total += int((task / "schedstat").read_text().split()[0])
    return total


def children() -> list[int]:
    """This process's child processes (milvus-lite's server)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a process that ended
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(stat.parent.name))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=40, help="rows a write (a c=1 flush)")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = MilvusStore(str(Path(tmp) / "cache.db"), "write_cost", args.dim)
        try:
            server = children()
            vector: Vector = np.zeros(args.dim, np.float32)
            vector[0] = 1.0
            own, lite, n = [], [], 0
            for b in range(WARMUP + args.batches):
                rows = []
                for _ in range(args.batch):
                    n += 1
                    text = f"where is my parcel {n}"
                    now = time.time()
                    key = exact_key(SCOPE, text)
                    rows.append((Entry(key, SCOPE, text, b"\n\x05label", now, now + 3600), vector))
                before = task_cpu_ns([os.getpid()]), task_cpu_ns(server)
                store.upsert(rows)
                after = task_cpu_ns([os.getpid()]), task_cpu_ns(server)
                if b >= WARMUP:
                    own.append((after[0] - before[0]) / 1e6 / args.batch)
                    lite.append((after[1] - before[1]) / 1e6 / args.batch)
                time.sleep(0.05)  # as the writer's flush interval leaves the server idle
        finally:
            store.close()
    print(
        f"batch {args.batch}, dim {args.dim}, {args.batches} batches: "
        f"this process {statistics.median(own):.3f} ms a row, "
        f"milvus-lite {statistics.median(lite):.3f} ms a row"
    )


if __name__ == "__main__":
    main()
