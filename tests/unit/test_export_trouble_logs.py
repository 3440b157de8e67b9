"""The OpenTelemetry SDK's lines about a collector it cannot reach, one a minute of each
kind (observability/logs.py:ExportTrouble): with the collector away every batch logged a
line or two (an observability probe: 17 lines in 40 s, about 1,000 an hour a process)."""

from __future__ import annotations

import logging
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from hopline.observability.logs import EXPORT_LOGGERS, ExportTrouble, LogFormat, setup_logging
from hopline.observability.otlp import OtlpSpanExporter

FAILED = "Failed to export %s to %s, error code: %s, error details: %s"
FULL = "Queue full, dropping %s."


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(EXPORT_LOGGERS[0], logging.ERROR, __file__, 1, msg, args, None)


def test_one_line_a_minute_of_each_kind_saying_how_many_were_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    trouble = ExportTrouble()
    said = [
        trouble.filter(_record(FAILED, "traces", "x:4317", "UNAVAILABLE", "")) for _ in range(5)
    ]
    assert said == [True, False, False, False, False]
    assert trouble.filter(_record(FULL, "span"))  # another kind: its own minute
    now[0] += 61
    again = _record(FAILED, "traces", "x:4317", "UNAVAILABLE", "")
    assert trouble.filter(again)
    assert getattr(again, "left_out", None) == 4


def test_the_sdks_export_loggers_get_the_filter() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("test", fmt=LogFormat.TEXT)
        for name in EXPORT_LOGGERS:
            assert any(isinstance(f, ExportTrouble) for f in logging.getLogger(name).filters)
    finally:
        root.handlers[:], root.level = handlers, level


def test_the_end_of_an_outage_is_said_once_with_how_long_it_lasted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The failures were said (once a minute) but not their end: an operator could not tell
    from the log whether spans flowed again. The SDK's own export (the gRPC call) is replaced
    by a list of results; the exporter's wrapper around it is the real one."""
    results = [SpanExportResult.FAILURE] * 3 + [SpanExportResult.SUCCESS] * 2
    monkeypatch.setattr(OTLPSpanExporter, "export", lambda self, spans: results.pop(0))
    exporter = OtlpSpanExporter(Resource.create({}))
    try:
        with caplog.at_level(logging.INFO, logger="hopline.observability.otlp"):
            outcomes = [exporter.export([]) for _ in range(5)]
    finally:
        exporter.shutdown()
    assert outcomes[-1] is SpanExportResult.SUCCESS
    [line] = [r for r in caplog.records if "works again" in r.getMessage()]
    assert getattr(line, "failed_batches", None) == 3
    assert getattr(line, "failing_s", -1.0) >= 0
