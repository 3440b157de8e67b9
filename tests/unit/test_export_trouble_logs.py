"""The OpenTelemetry SDK's lines about a collector it cannot reach, one a minute of each
kind (observability/logs.py:ExportTrouble): with the collector away every batch logged a
line or two (an observability probe: 17 lines in 40 s, about 1,000 an hour a process)."""

from __future__ import annotations

import logging
import time

import pytest

from hopline.observability.logs import EXPORT_LOGGERS, ExportTrouble, LogFormat, setup_logging

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
