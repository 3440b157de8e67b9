"""`hopline run`'s supervisor (cli/run.py:Restarts): when a service that exited starts again.

A fake clock; the supervisor with real processes is tests/mesh/test_run_ready.py."""

from __future__ import annotations

import pytest

from hopline.cli import run
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


class ExitingMesh:
    """A mesh whose `failing` service exits again as soon as it is started; the rest run."""

    def __init__(self, failing: str) -> None:
        self.failing = failing
        self.starts = 0
        self.down = True
        self.procs = {failing: self}

    def poll(self) -> int:  # as its process: exited
        return 1

    def exited(self) -> dict[str, int]:
        return {self.failing: 1} if self.down else {}

    def spawn(self, names: list[str]) -> None:
        assert names == [self.failing]
        self.starts += 1  # and it exits at once: still down at the next look

    def serving(self, name: str) -> bool:
        return False


def run_for(mesh: ExitingMesh, seconds: float) -> int:
    """`supervise` over `mesh` on a fake clock, until `seconds` have passed on it."""
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    return run.supervise(mesh, lambda: now[0] >= seconds, lambda: now[0], sleep)  # type: ignore[arg-type]


def test_a_cache_that_keeps_exiting_leaves_the_mesh_serving_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway fails open past the cache: a cache that kept exiting (a damaged file)
    stopped a mesh that was answering every request (a cache probe). It is started again
    every RETRY_WITHOUT_S instead; any other service that keeps exiting stops the mesh."""
    cache = ExitingMesh("cache")
    assert run_for(cache, 10 * run.RETRY_WITHOUT_S) == 0
    assert cache.starts > MAX_RESTARTS + 5  # started again well past the limit
    assert "the mesh serves on without it" in caplog.text

    inference = ExitingMesh("inference")
    assert run_for(inference, 10 * run.RETRY_WITHOUT_S) == 1
    assert inference.starts == MAX_RESTARTS
