"""A caller's malformed or oversized `baggage` header: OpenTelemetry's propagator warned of
each one, echoing it, before the caller's key was checked, so any client wrote the gateway's
log a line a request (a fuzzing probe: 400 lines for 400 requests, 7 KB each for a 7 KB
member). Now one INFO line a minute per kind, without the caller's text
(observability/logs.py:CallerHeaders), through the propagator hopline calls."""

from __future__ import annotations

import logging
import time

import pytest
from opentelemetry import propagate

from hopline.observability.logs import (
    BAGGAGE_LOGGER,
    TRACE_CONTEXT_LOGGER,
    CallerHeaders,
    LogFormat,
    setup_logging,
)


def test_a_flood_of_bad_baggage_is_one_line_without_the_callers_text(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    logger = logging.getLogger(BAGGAGE_LOGGER)
    kept = logger.filters[:]
    logger.filters[:] = [CallerHeaders("baggage")]
    secret = "s3cret-" + "x" * 7000
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(200):
                propagate.extract({"baggage": f"k={secret}"})
                propagate.extract({"baggage": ",".join(f"k{n}=v" for n in range(200))})
            lines = [r for r in caplog.records if r.name == BAGGAGE_LOGGER]
            assert 1 <= len(lines) <= 2  # one a kind
            assert all(r.levelno == logging.INFO for r in lines)
            assert all("s3cret" not in r.getMessage() for r in lines)
            assert all("%" not in r.getMessage() for r in lines)  # "with length %d" was left
            assert all("baggage header was dropped" in r.getMessage() for r in lines)
            now[0] += 61
            caplog.clear()
            propagate.extract({"baggage": f"k={secret}"})
            again = [r for r in caplog.records if r.name == BAGGAGE_LOGGER]
            assert len(again) == 1
            assert getattr(again[0], "left_out", 0) >= 199
    finally:
        logger.filters[:] = kept


def test_setup_logging_filters_the_propagators_logger() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("test", fmt=LogFormat.TEXT)
        for name in (BAGGAGE_LOGGER, TRACE_CONTEXT_LOGGER):
            filters = logging.getLogger(name).filters
            assert sum(isinstance(f, CallerHeaders) for f in filters) == 1
    finally:
        root.handlers[:], root.level = handlers, level


def test_oversized_trace_context_headers_are_one_line_a_minute(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The trace-context propagator warned of each `traceparent` or `tracestate` over its
    512 characters: a hostile client's probe wrote a line a request with 64 KB headers."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    logger = logging.getLogger(TRACE_CONTEXT_LOGGER)
    kept = logger.filters[:]
    logger.filters[:] = [CallerHeaders("trace context")]
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(100):
                propagate.extract({"traceparent": "00-" + "a" * 70000})
            lines = [r for r in caplog.records if r.name == TRACE_CONTEXT_LOGGER]
            assert len(lines) == 1
            assert lines[0].levelno == logging.INFO
            assert "trace context header was dropped" in lines[0].getMessage()
    finally:
        logger.filters[:] = kept
