"""observability/logs.py:Episodes: a failure that repeats with every request is logged once
when it starts, summed while it lasts and once when it is over (a clock of the test's own)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fake_clock import FakeClock

from hopline.observability.logs import Episodes

LOGGER = "hopline.test.episodes"


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, dict[str, Any]]]:
    """(level, message, the fields that came with it) of each record so far."""
    standard = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}
    return [
        (
            r.levelname,
            r.getMessage(),
            {k: v for k, v in r.__dict__.items() if k not in standard},
        )
        for r in caplog.records
        if r.name == LOGGER
    ]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def episodes(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> Episodes:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return Episodes(logging.getLogger(LOGGER), "hop failed", summary_s=10, quiet_s=1, clock=clock)


def test_a_failure_on_every_request_is_said_once_summed_then_over(
    episodes: Episodes, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    key = ("postprocess", "10.0.0.7:8014")
    for i in range(100):  # 100 requests over 9.9 s
        clock.now = 100 + i * 0.099
        episodes.failed(key, "UNAVAILABLE", hop="postprocess", status="UNAVAILABLE")
    assert lines(caplog) == [
        ("WARNING", "hop failed", {"hop": "postprocess", "status": "UNAVAILABLE"})
    ]
    clock.now = 110.0
    episodes.failed(key, "UNAVAILABLE", hop="postprocess", status="UNAVAILABLE")
    summary = lines(caplog)[1]
    assert summary == (
        "WARNING",
        "hop failed",
        {"hop": "postprocess", "status": "UNAVAILABLE", "more_failures": 100, "since_s": 10.0},
    )
    # A success within the quiet time after the last failure (another replica answering)
    # does not end it; one after it does, once, with every failure counted.
    clock.now = 110.5
    episodes.ended(key)
    assert len(lines(caplog)) == 2
    clock.now = 111.5
    episodes.ended(key)
    episodes.ended(key)
    assert lines(caplog)[2:] == [
        (
            "INFO",
            "hop failed: over",
            {"hop": "postprocess", "status": "UNAVAILABLE", "failures": 101, "lasted_s": 11.5},
        )
    ]
    assert episodes.open() == 0
    # The next failure starts a new episode, said at once.
    episodes.failed(key, "UNAVAILABLE", hop="postprocess", status="UNAVAILABLE")
    assert len(lines(caplog)) == 4


def test_another_status_is_said_at_once_and_keys_are_apart(
    episodes: Episodes, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    episodes.failed("a", "UNAVAILABLE", status="UNAVAILABLE")
    episodes.failed("a", "UNAVAILABLE", status="UNAVAILABLE")
    episodes.failed("a", "INTERNAL", status="INTERNAL")
    episodes.failed("b", "UNAVAILABLE", status="UNAVAILABLE")
    assert [fields["status"] for _, _, fields in lines(caplog)] == [
        "UNAVAILABLE",
        "INTERNAL",
        "UNAVAILABLE",
    ]
    clock.now += 2
    episodes.ended("a")
    assert lines(caplog)[-1][1:] == (
        "hop failed: over",
        {"status": "UNAVAILABLE", "failures": 3, "lasted_s": 2.0},
    )
    assert episodes.open() == 1  # "b" still failing
    episodes.ended("c")  # a success nothing failed before: nothing to say
    assert len(lines(caplog)) == 4
