"""`closed_loop(pause_s=...)` (`hopline bench`'s echo_idle baseline): each caller waits that
long after each reply before its next call, and the wait is not part of any latency."""

from __future__ import annotations

import asyncio

import pytest

from hopline.bench.cli import bench_once
from hopline.bench.load import closed_loop


async def _instant(payload: int) -> int:
    return payload


def _run(pause_s: float) -> tuple[int, int]:
    """(requests, longest latency in ns) of 2 callers over 0.2 s."""
    run = asyncio.run(
        closed_loop(_instant, lambda i: i, concurrency=2, duration_s=0.2, pause_s=pause_s)
    )
    return len(run.latencies_ns), max(run.latencies_ns)


def test_the_pause_spaces_calls_and_is_not_timed() -> None:
    requests, longest_ns = _run(0.02)
    # 2 callers, one call per 20 ms each over 0.2 s: 11 each at most (the first at once).
    assert 2 <= requests <= 22
    # A call that returns at once took far less than the 20 ms its caller then waited.
    assert longest_ns < 20_000_000
    unpaused, _ = _run(0.0)
    assert unpaused > 10 * requests


def test_echo_idle_is_refused_in_open_loop() -> None:
    """Arrivals on a schedule have no caller to idle: a run that ignored --idle-ms would be
    an echo labelled echo_idle."""
    with pytest.raises(SystemExit, match="use --concurrency, not --rps"):
        bench_once("--target", "none", "--rps", "10", "--baseline", "echo_idle")
