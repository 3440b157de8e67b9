"""`hopline run`'s supervisor (cli/run.py:Restarts): when a service that exited starts again.

A fake clock; the supervisor with real processes is tests/mesh/test_run_ready.py."""

from __future__ import annotations

from hopline.cli.run import (
    MAX_RESTART_BACKOFF_S,
    MAX_RESTARTS,
    RESTART_BACKOFF_S,
    RESTART_WINDOW_S,
    Restarts,
)


def test_the_backoff_doubles_and_a_service_that_keeps_exiting_stops_the_mesh() -> None:
    now = [0.0]
    restarts = Restarts(lambda: now[0])
    delays = []
    for _ in range(MAX_RESTARTS):
        delay = restarts.delay("cache")
        assert delay is not None
        delays.append(delay)
        now[0] += delay + 1.0  # it started again and ran a second
    assert delays == [
        min(RESTART_BACKOFF_S * 2**i, MAX_RESTART_BACKOFF_S) for i in range(MAX_RESTARTS)
    ]
    assert restarts.delay("cache") is None  # one exit too many within the window
    assert restarts.delay("gateway") == RESTART_BACKOFF_S  # counted per service


def test_exits_older_than_the_window_are_forgiven() -> None:
    now = [0.0]
    restarts = Restarts(lambda: now[0])
    for _ in range(MAX_RESTARTS):
        restarts.delay("cache")
    now[0] += RESTART_WINDOW_S
    assert restarts.delay("cache") == RESTART_BACKOFF_S
