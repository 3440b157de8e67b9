"""`hopline run` bounds each health check itself (runtime/launcher.py:Mesh._check): a check
whose gRPC deadline never fires gives up after CHECK_BOUND_S, so the supervisor goes on and
hears Ctrl-C.

The thread limit that stopped gRPC core's timers (a pids limit reached mid-run) cannot be
reached here: the check is a stand-in that waits as gRPC's blocking call does when its
deadline never fires, in 0.2 s waits between which Python's signal handlers run, never
returning within the test.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import pytest

from hopline.runtime import launcher
from hopline.runtime.launcher import Mesh

HUNG_S = 20.0  # the stand-in's wait: the check would return True (SERVING) only after this
OUTER_S = 100.0


def _hung_health_status(*_: object, **__: object) -> int:
    """gRPC core's blocking wait with no timer thread: 0.2 s waits, signal handlers between."""
    until = time.monotonic() + HUNG_S
    while time.monotonic() < until:
        time.sleep(0.2)
    return launcher.SERVING


def test_a_check_whose_deadline_never_fires_is_given_up_and_said_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(launcher, "health_status", _hung_health_status)
    monkeypatch.setattr(launcher, "CHECK_BOUND_S", 0.3)
    mesh = Mesh(tmp_path, bound_checks=True)
    handler = signal.getsignal(signal.SIGALRM)
    # An alarm of the caller's (as pytest-timeout's is), in place of whichever was running.
    before = signal.setitimer(signal.ITIMER_REAL, OUTER_S)
    try:
        with caplog.at_level(logging.WARNING, logger="hopline.launcher"):
            answers = [mesh.serving("tokenizer") for _ in range(2)]
        outer_left = signal.getitimer(signal.ITIMER_REAL)[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, *before)

    assert answers == [False, False]  # the stand-in would have said SERVING after HUNG_S
    said = [r for r in caplog.records if "outlived its deadline" in r.getMessage()]
    assert len(said) == 1
    # The caller's alarm is set again for what was left of it, under its own handler.
    assert signal.getsignal(signal.SIGALRM) == handler
    assert OUTER_S - 5 < outer_left < OUTER_S


def test_without_the_bound_a_check_runs_to_its_own_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(launcher, "health_status", lambda *_, **__: launcher.SERVING)
    assert Mesh(tmp_path).serving("tokenizer") is True
    assert Mesh(tmp_path, bound_checks=True).serving("tokenizer") is True
