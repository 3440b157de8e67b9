"""The load engine of `hopline bench`: closed and open loops over any target.

Kept cheap on purpose, because on a 2-core machine every cycle the load generator burns is
taken from the system it measures:
- payloads are built (for gRPC targets: serialised) before the measured window;
- a completed request costs two clock reads and three appends: responses are kept as raw
  bytes and decoded only after the window (outcome counts, per-hop timings);
- one caller of a gRPC target blocks on gRPC's synchronous stub in a thread of its own: a
  grpc.aio reply reaches the event loop through gRPC's poller thread, a crossing a Go or
  Java client does not make, which on 2 cores put 0.12 ms on every c=1 latency (exact
  repeats through the co-located mesh, 3 alternated rounds: p50 0.657 ms on grpc.aio,
  0.535 blocking, ghz 0.547). More callers stay on grpc.aio: a thread each would cost the
  measured machine more than the crossing;
- the open loop schedules Poisson arrivals from a precomputed list and measures each
  request from its scheduled arrival, so a late load generator shows up as latency instead
  of silently sending less (no coordinated omission);
- its own CPU time is read from the kernel for the window and reported beside the results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import resource
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import numpy as np

OK = "OK"


class TargetError(Exception):
    """A failed call whose status is not a gRPC one (an in-process target's exception)."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


Call = Callable[[Any], Awaitable[Any]]
# One request on the calling thread: a target's blocking call, for a closed loop of one caller.
BlockingCall = Callable[[Any], Any]


@dataclasses.dataclass
class Run:
    """What one measured window produced, before any decoding."""

    latencies_ns: list[int]
    statuses: list[str]
    responses: list[Any]  # OK responses, raw, in completion order
    duration_s: float
    loadgen_cpu_s: float
    machine_busy: float  # share of all cores busy during the window (/proc/stat)
    offered_rps: float | None = None
    latency_growth: float | None = None  # open loop: `latency_growth` of the window

    @property
    def completed(self) -> int:
        """Calls that finished in the window, answered or failed."""
        return len(self.latencies_ns)

    @property
    def answered_ns(self) -> list[int]:
        """The latencies of the calls answered OK: what throughput and the percentiles are
        of. A failed call is often the fastest of all (an unreachable target refuses in
        microseconds), so counting it would flatter a failing target."""
        pairs = zip(self.latencies_ns, self.statuses, strict=True)
        return [ns for ns, status in pairs if status == OK]

    @property
    def answered(self) -> int:
        return self.statuses.count(OK)

    @property
    def errors(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for status in self.statuses:
            if status != OK:
                counts[status] = counts.get(status, 0) + 1
        return counts


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all cores; (0, 0) where /proc/stat does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class _Window:
    """CPU and machine counters around a measured window."""

    def __enter__(self) -> _Window:
        self.cpu0, self.ticks0 = _cpu_s(), _machine_ticks()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.t0
        self.cpu = _cpu_s() - self.cpu0
        busy1, total1 = _machine_ticks()
        total = total1 - self.ticks0[1]
        self.busy = (busy1 - self.ticks0[0]) / total if total else 0.0


def _status(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError | grpc.Call):  # grpc.aio's, or a blocking stub's
        return exc.code().name
    if isinstance(exc, TargetError):
        return exc.status
    return type(exc).__name__


class _Tally:
    """What one phase recorded: latencies, statuses and the responses to decode later."""

    def __init__(self, record: bool) -> None:
        self.record = record
        self.lat: list[int] = []
        self.st: list[str] = []
        self.out: list[Any] = []
        self.since: list[int] = []  # each latency's start (an open loop's arrival)

    def add(self, since_ns: int, status: str, response: Any = None) -> None:
        if self.record:
            self.lat.append(time.perf_counter_ns() - since_ns)
            self.since.append(since_ns)
            self.st.append(status)
            if response is not None:
                self.out.append(response)

    async def send(self, call: Call, payload: Any, since_ns: int) -> None:
        """One request, timed from `since_ns` (its start, or its scheduled arrival)."""
        try:
            response = await call(payload)
        except Exception as exc:
            self.add(since_ns, _status(exc))
        else:
            self.add(since_ns, OK, response)

    def send_blocking(self, call: BlockingCall, payload: Any, since_ns: int) -> None:
        """`send` on this thread, with a blocking call."""
        try:
            response = call(payload)
        except Exception as exc:
            self.add(since_ns, _status(exc))
        else:
            self.add(since_ns, OK, response)

    def result(self) -> tuple[list[int], list[str], list[Any]]:
        return self.lat, self.st, self.out

    def growth(self) -> float | None:
        return latency_growth(self.since, self.lat)


# An open loop the target keeps up with has latencies that come and go with the arrivals'
# bursts; one it does not keep up with builds a queue, and each arrival waits longer than the
# one before. Above this `latency_growth` the window measured a queue, not the target.
MAX_LATENCY_GROWTH = 2.0


def latency_growth(arrivals_ns: Sequence[int], latencies_ns: Sequence[int]) -> float | None:
    """The median latency of the last quarter of arrivals over that of the first quarter.

    Near 1 while the target keeps up (the first quarter starts from an empty queue, so a
    little above 1); about 2 or more where the queue grows through the window, whatever its
    slope, because the latency then rises with the arrival time. None with under 8 requests.
    """
    if len(arrivals_ns) < 8:
        return None
    ordered = [lat for _, lat in sorted(zip(arrivals_ns, latencies_ns, strict=True))]
    quarter = len(ordered) // 4
    first = float(np.median(ordered[:quarter]))
    last = float(np.median(ordered[-quarter:]))
    return last / first if first > 0 else None


async def closed_loop(
    call: Call,
    payload: Callable[[int], Any],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.0,
    pause_s: float = 0.0,
    at_window: Callable[[], None] | None = None,
    blocking: BlockingCall | None = None,
) -> Run:
    """`concurrency` callers, each sending its next request as soon as the last returns, or
    `pause_s` after it (the pause is not part of a request's latency). With `blocking` (the
    same requests as `call`, on the calling thread), one caller runs on a thread of its own
    with it (the module's docstring says why)."""
    counter = iter(range(1 << 62))

    def blocking_caller(
        send: BlockingCall, tally: _Tally, stop_at: int, cancelled: threading.Event
    ) -> None:
        while (started := time.perf_counter_ns()) < stop_at and not cancelled.is_set():
            tally.send_blocking(send, payload(next(counter)), started)
            if pause_s > 0:
                time.sleep(pause_s)

    async def phase(seconds: float, record: bool) -> tuple[list[int], list[str], list[Any]]:
        tally = _Tally(record)
        stop_at = time.perf_counter_ns() + int(seconds * 1e9)

        async def caller() -> None:
            while (started := time.perf_counter_ns()) < stop_at:
                await tally.send(call, payload(next(counter)), started)
                if pause_s > 0:
                    await asyncio.sleep(pause_s)

        if concurrency == 1 and blocking is not None:
            cancelled = threading.Event()  # a cancelled window ends after its current call
            try:
                await asyncio.to_thread(blocking_caller, blocking, tally, stop_at, cancelled)
            finally:
                cancelled.set()
        else:
            await asyncio.gather(*(caller() for _ in range(concurrency)))
        return tally.result()

    if warmup_s > 0:
        await phase(warmup_s, record=False)
    if at_window is not None:  # between the phases: nothing is in flight
        at_window()
    with _Window() as window:
        lat, st, out = await phase(duration_s, record=True)
    # Requests still running when the window closed finish after it: divide by the time the
    # last one took, not by the nominal duration, so throughput is not overstated.
    return Run(lat, st, out, window.elapsed, window.cpu, window.busy)


async def open_loop(
    call: Call,
    payload: Callable[[int], Any],
    *,
    rps: float,
    duration_s: float,
    warmup_s: float = 0.0,
    max_in_flight: int = 20_000,
    seed: int = 0,
    at_window: Callable[[], None] | None = None,
) -> Run:
    """Poisson arrivals at `rps`; each request's latency counts from its scheduled arrival."""
    rng = np.random.default_rng(seed)
    counter = iter(range(1 << 62))

    async def phase(seconds: float, record: bool) -> _Tally:
        gaps = rng.exponential(1.0 / rps, size=int(rps * seconds * 1.5) + 16)
        arrivals = np.cumsum(gaps)
        arrivals_ns = (arrivals[arrivals < seconds] * 1e9).astype(np.int64).tolist()
        tally = _Tally(record)
        tasks: set[asyncio.Task[None]] = set()

        start = time.perf_counter_ns()
        for offset in arrivals_ns:
            due = start + offset
            wait = due - time.perf_counter_ns()
            if wait > 0:
                await asyncio.sleep(wait / 1e9)
            if len(tasks) >= max_in_flight:
                # The target is so far behind that the generator would run out of memory:
                # count the arrival as shed here rather than pretend it was served.
                tally.add(due, "LOADGEN_OVERFLOW")
                continue
            task = asyncio.create_task(tally.send(call, payload(next(counter)), due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks))
        return tally

    if warmup_s > 0:
        await phase(warmup_s, record=False)
    if at_window is not None:  # between the phases: nothing is in flight
        at_window()
    with _Window() as window:
        tally = await phase(duration_s, record=True)
    lat, st, out = tally.result()
    return Run(
        lat,
        st,
        out,
        window.elapsed,
        window.cpu,
        window.busy,
        offered_rps=rps,
        latency_growth=tally.growth(),
    )


def percentiles_ms(latencies_ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p99/p99.9/max from an HDR histogram (1 us to 10 min, 3 significant digits)."""
    from hdrh.histogram import HdrHistogram

    hist = HdrHistogram(1, 600_000_000, 3)
    for ns in latencies_ns:
        hist.record_value(max(1, ns // 1000))
    if not latencies_ns:
        return {k: float("nan") for k in ("p50_ms", "p90_ms", "p99_ms", "p99_9_ms", "max_ms")}
    return {
        "p50_ms": hist.get_value_at_percentile(50) / 1e3,
        "p90_ms": hist.get_value_at_percentile(90) / 1e3,
        "p99_ms": hist.get_value_at_percentile(99) / 1e3,
        "p99_9_ms": hist.get_value_at_percentile(99.9) / 1e3,
        "max_ms": hist.get_max_value() / 1e3,
    }
