"""An open loop's `latency_growth`: near 1 when the target keeps up with the arrivals, about 2
or more when a queue builds through the window; `make bench`'s open-loop row is not met then
(`bench/suite_report.py:open_loop_judgement`), because its p50 and p99 measure the queue."""

from __future__ import annotations

import asyncio
import time

from hopline.bench.load import MAX_LATENCY_GROWTH, latency_growth, open_loop
from hopline.bench.suite_report import open_loop_judgement


def _run(rps: float, service_s: float, *, serial: bool) -> float | None:
    """The growth of a 1.2 s open loop against a target taking `service_s` a request: one
    request at a time (`serial`: arrivals faster than that queue), or all at once (no queue
    whatever the load, so a busy machine slows every request alike)."""

    async def go() -> float | None:
        lock = asyncio.Lock()

        async def call(payload: int) -> int:
            if serial:
                async with lock:
                    await asyncio.sleep(service_s)
            else:
                await asyncio.sleep(service_s)
            return payload

        run = await open_loop(call, lambda i: i, rps=rps, duration_s=1.2, seed=3)
        assert run.completed == len(run.latencies_ns) > 0
        return run.latency_growth

    return asyncio.run(go())


def test_a_target_that_keeps_up_stays_near_one() -> None:
    # 20 ms a request, not 2: a loaded machine stalls this loop for a few milliseconds now and
    # then, which doubled a 2 ms request's latency near the window's end (it failed once in a
    # unit lane beside three meshes); calls all at once never queue, whatever they take.
    growth = _run(100, 0.02, serial=False)
    assert growth is not None
    assert growth < MAX_LATENCY_GROWTH


def test_a_queue_building_through_the_window_is_seen() -> None:
    # 200 arrivals a second, 8 ms each, one at a time: 1.6x what it serves.
    growth = _run(200, 0.008, serial=True)
    assert growth is not None
    assert growth > MAX_LATENCY_GROWTH


def test_growth_orders_by_arrival_not_completion() -> None:
    start = time.perf_counter_ns()
    arrivals = [start + i for i in range(8)]
    # Completed in reverse order of arrival: the latest arrivals waited 8x as long.
    assert latency_growth(arrivals, [1, 1, 2, 2, 4, 4, 8, 8]) == 8.0
    assert latency_growth(list(reversed(arrivals)), [1, 1, 2, 2, 4, 4, 8, 8]) == 1 / 8
    assert latency_growth(arrivals[:7], [1] * 7) is None


def _record(p50: float, p99: float, growth: float | None) -> dict[str, object]:
    return {"p50_ms": p50, "p99_ms": p99, "errors": 0, "latency_growth": growth}


def test_the_open_loop_row_needs_the_target_to_keep_up() -> None:
    # Stop 45's co-located run: p99 2.64x p50, but its p50 was a 372 ms queue.
    ratio, met, how = open_loop_judgement(_record(371.7, 980.5, 3.4))
    assert ratio < 3.0
    assert not met
    assert "did not keep up" in how
    ratio, met, how = open_loop_judgement(_record(80.4, 211.2, 1.1))
    assert met
    assert "kept up" in how
    _, met, _ = open_loop_judgement(_record(10.0, 40.0, 1.0))
    assert not met  # the tail itself
    _, met, how = open_loop_judgement(_record(10.0, 20.0, None))
    assert met
    assert "not measured" in how
