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
    TRACE_STATE_LOGGER,
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
        for name in (BAGGAGE_LOGGER, TRACE_CONTEXT_LOGGER, TRACE_STATE_LOGGER):
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
    loggers = [logging.getLogger(n) for n in (TRACE_CONTEXT_LOGGER, TRACE_STATE_LOGGER)]
    kept = [logger.filters[:] for logger in loggers]
    for logger in loggers:
        logger.filters[:] = [CallerHeaders("trace context")]
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        with caplog.at_level(logging.INFO):
            for n in range(100):
                propagate.extract({"traceparent": "00-" + "a" * 70000})
                # A malformed member under 512 characters: TraceState echoed it a request.
                propagate.extract({"traceparent": parent, "tracestate": f"s3cret{n} =x" * 20})
            lines = [r for r in caplog.records if r.name.startswith("opentelemetry.trace")]
            assert len(lines) == 2  # one a kind
            assert all(r.levelno == logging.INFO for r in lines)
            assert all("trace context header was dropped" in r.getMessage() for r in lines)
            assert all("s3cret" not in r.getMessage() for r in lines)
    finally:
        for logger, filters in zip(loggers, kept, strict=True):
            logger.filters[:] = filters
