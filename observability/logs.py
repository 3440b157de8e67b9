"""Structured logs: one JSON object per line, carrying the current trace and span ids."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace

# Attributes every LogRecord has; anything else came from `extra=` and is logged as a field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        fields["trace_id"] = format(ctx.trace_id, "032x")
        fields["span_id"] = format(ctx.span_id, "016x")
    return fields


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable, for `make run` in a terminal; the same fields as key=value."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname[0]} {self.service:<11} "
        line += f"{record.getMessage()} {extras}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter(service) if fmt == "text" else JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
