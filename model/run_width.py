"""How many runs of an ONNX Runtime model go side by side on the CPU, and how wide each is.

Shared by the inference service's backend (services/inference/backend.py:SideBySideBackend,
which has the measurements behind the rule) and the cache's embedder (cache/embedder.py): a
run alone takes every core, runs side by side one core each, and a run alone takes one core
too while most recent runs had company; there is one run slot more than there are cores.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from hopline.runtime.cpu_quota import usable_cpus

# A run alone takes every core only while fewer than NARROW_FROM of the last COMPANY_WINDOW
# or so runs (a moving average) ran beside another: see SideBySideBackend.
COMPANY_WINDOW = 32
NARROW_FROM = 0.25

# Rows in one run on the CPU (a model version's `dynamic_batching.max_batch_size` as built, the
# embedder's batches; more wait for the next run slot). A CPU's cost a row is flat past a few
# rows, while a run's length grows with its rows, and so does its padding (rows are padded to
# the longest). Co-located mesh, 2-core Xeon VM, against 32, 6 alternated rounds each: 32
# callers 304.9 -> 326.6 rps (higher in 5 of 6, p99 211.4 -> 182.8 ms), 230 rps open loop p50
# 25.2 -> 23.4 and p99 106.6 -> 97.6 ms. GPUs gain from large runs: a version whose first
# provider is a GPU keeps runtime/batching.py:DEFAULT_MAX_BATCH.
CPU_RUN_ROWS = 12


def cores() -> int:
    """The whole cores this process may keep busy: its affinity, within its cgroups' CPU
    quota (runtime/cpu_quota.py)."""
    return usable_cpus()


def run_slots(workers: int) -> int:
    """Model runs in parallel: `workers`, or for 0 one per core and one more.

    The extra run keeps the cores busy between runs: a run that ends leaves its core idle until
    the event loop wakes, finds the next batch and hands it to a worker thread, and at 32
    callers through the co-located mesh (2 cores) only one run was going 9.4% of the time with
    one slot per core. A third run, already started, takes the freed core at once. With the
    gateway keeping as many inference calls on their way (stop 57; since stop 89 a co-located
    gateway calls the service per request, and its misses queue here: see
    gateway/stage_batching.py:GatewayStages.over), alternated rounds of c=32 misses, co-located,
    against one slot per core and one call: 319.1 -> 334.2 rps (6 rounds), 313.3 -> 319.3 (5
    rounds), 308.3 -> 325.7 (4 rounds; 3 and 2 calls on their way in the first two runs); five
    processes 233.9 -> 237.5 (6 rounds: the gateway sends one call per stage and length bucket
    there). The in-process batcher (`hopline bench`'s inprocess_batched) 410.7 -> 406.5 (5
    rounds, within its noise). As landed (stop 57), against the code before, 6 alternated rounds
    each, co-located: c=32 303.3 -> 323.4 rps (p99 211.6 -> 195.0 ms), open loop at 210 rps p50
    29.6 -> 21.5 ms and p99 147.7 -> 102.1, c=1 miss p50 4.709 vs 4.720 ms (one run at a
    time: unchanged)."""
    return workers if workers > 0 else cores() + 1


class RunWidth:
    """Whether the next run takes the every-core session (wide) or a one-core one (narrow).

    Wide when no other run is in progress and fewer than `NARROW_FROM` of the recent runs
    had company (another run in progress when it started, or one started before it ended).
    Thread-safe: runs start and end on worker threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._started = 0  # runs started, to tell whether another started during a run
        self.company = 0.0  # the share of recent runs that had company (moving average)
        self.wide_runs = 0  # counted for tests and stats: which session answered
        self.narrow_runs = 0

    @contextlib.contextmanager
    def run(self) -> Iterator[bool]:
        """Around one run: yields True for the wide session, False for a narrow one."""
        with self._lock:
            self._running += 1
            self._started += 1
            started = self._started
            beside = self._running > 1
            wide = not beside and self.company < NARROW_FROM
            if wide:
                self.wide_runs += 1
            else:
                self.narrow_runs += 1
        try:
            yield wide
        finally:
            with self._lock:
                self._running -= 1
                had_company = beside or self._started > started
                self.company += (float(had_company) - self.company) / COMPANY_WINDOW
