"""Structured logs: one JSON object per line, carrying the current trace and span ids."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

from opentelemetry import trace


class LogLevel(enum.StrEnum):
    """HOPLINE_LOG_LEVEL: the least severe record written."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.StrEnum):
    """HOPLINE_LOG_FORMAT: one JSON object a line, or text for a terminal."""

    JSON = "json"
    TEXT = "text"


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


# user:password@ in a URI (a Milvus server's, an endpoint's): the password is never logged.
# Up to the last @ of the word: a password may hold / or @ unescaped (`root:Ab/cd@host`,
# `root:p@ss@host` were logged whole or in part: a reviewer's probe); more hidden is safe.
_URI_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)(\S*)@")
_PORT_AND_PATH = re.compile(r"\d+(/\S*)?")  # host:port/path@...: no password there


def _hidden(match: re.Match[str]) -> str:
    if _PORT_AND_PATH.fullmatch(match[2]):
        return match[0]
    return f"{match[1]}***@"


def has_password(text: str) -> bool:
    """Whether `text` holds a URI with a password (the form `without_passwords` hides)."""
    return _URI_PASSWORD.sub(_hidden, text) != text


def without_passwords(value: object) -> object:
    """`value` with the password of any URI in it (a string, or a mapping's strings) shown as
    `***`: HOPLINE_CACHE_URI with user:password in it was logged whole in the start-up
    "config" line (a security probe)."""
    if isinstance(value, str):
        return _URI_PASSWORD.sub(_hidden, value)
    if isinstance(value, dict):
        return {key: without_passwords(v) for key, v in value.items()}
    return value


def setup_logging(
    service: str, level: LogLevel = LogLevel.INFO, fmt: LogFormat = LogFormat.JSON
) -> None:
    handler = logging.StreamHandler(sys.stderr)
    text = fmt is LogFormat.TEXT
    handler.setFormatter(TextFormatter(service) if text else JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.value.upper())
    grpc_server = logging.getLogger(GRPC_AIO_SERVER_LOGGER)
    if not any(isinstance(f, RepliesAfterTheCallEnded) for f in grpc_server.filters):
        grpc_server.addFilter(RepliesAfterTheCallEnded())
    for name in EXPORT_LOGGERS:
        export = logging.getLogger(name)
        if not any(isinstance(f, ExportTrouble) for f in export.filters):
            export.addFilter(ExportTrouble())
    for name, header in CALLER_HEADER_LOGGERS.items():
        propagator = logging.getLogger(name)
        if not any(isinstance(f, CallerHeaders) for f in propagator.filters):
            propagator.addFilter(CallerHeaders(header))


class OncePer:
    """At most one line per key every `every_s`, counting the ones left out between: the
    rule of the filters below."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._said: dict[str, tuple[float, int]] = {}  # key -> when said, left out since

    def due(self, key: str) -> int | None:
        """How many lines of `key` were left out since the last, when one is due now; None
        when it is not."""
        now = time.monotonic()
        last, held = self._said.get(key, (-math.inf, 0))
        if now - last < self.every_s:
            self._said[key] = (last, held + 1)
            return None
        self._said[key] = (now, 0)
        return held


GRPC_AIO_SERVER_LOGGER = "grpc._cython.cygrpc"
# What grpc.aio's server logs, with a traceback at ERROR, when a servicer's reply cannot be
# handed to gRPC core: the call has ended before it (grpc 1.85).
EXECUTE_BATCH_ERROR = "ExecuteBatchError raised in core by servicer method "
REPLIES_AFTER_END_EVERY_S = 60.0


class RepliesAfterTheCallEnded(logging.Filter):
    """grpc.aio's ERROR with a traceback for a reply it could not send, as one INFO line a
    minute per method: it comes when the call ended first, the client's deadline passing as
    the reply was sent or the client cancelling a stream whose replies it had not read
    (helpers' probes: internal services under the gateway's short hop deadlines, a cancelled
    PredictStream held by flow control). That is the client's doing; the RPC's own span and
    metrics say how it ended."""

    def __init__(self) -> None:
        super().__init__()
        self._once = OncePer(REPLIES_AFTER_END_EVERY_S)  # per method: bounded by those served

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(EXECUTE_BATCH_ERROR):
            return True
        if not logging.getLogger().isEnabledFor(logging.INFO):
            return False
        method = message.removeprefix(EXECUTE_BATCH_ERROR).strip("[]")
        if self._once.due(method) is None:
            return False
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg = (
            "a reply was not sent: its call had ended first (the client's deadline passed or "
            "it cancelled); said once a minute per method"
        )
        record.args = None
        record.exc_info, record.exc_text = None, None
        record.method = method
        return True


# OpenTelemetry's propagators warn of every malformed or oversized header a caller sends, the
# baggage one echoing it: any client, before its key is checked, wrote a line a request (a
# 7 KB baggage member, 7 KB a line; a fuzzing probe, 400 lines for 400 requests; a hostile
# client's probe, a line for each `traceparent` or `tracestate` over 512 characters).
BAGGAGE_LOGGER = "opentelemetry.baggage.propagation"
TRACE_CONTEXT_LOGGER = "opentelemetry.trace.propagation.tracecontext"
# TraceState's, which parses a caller's `tracestate` under 512 characters and echoes each
# malformed member (its only warnings are about a trace state's members).
TRACE_STATE_LOGGER = "opentelemetry.trace.span"
CALLER_HEADER_LOGGERS = {
    BAGGAGE_LOGGER: "baggage",
    TRACE_CONTEXT_LOGGER: "trace context",
    TRACE_STATE_LOGGER: "trace context",
}
# A %-format field of a log template, quoted or not ("with length %d" was left in the line).
_FORMAT_FIELD = re.compile(r"`?%[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]`?")
CALLER_HEADERS_EVERY_S = 60.0


class CallerHeaders(logging.Filter):
    """A propagator's warnings about a caller's `header` (baggage, trace context) as one INFO
    line a minute per kind, without the caller's text: the header is dropped and the request
    served, so the line is news for whoever wrote the client, not an operator's alarm."""

    def __init__(self, header: str) -> None:
        super().__init__()
        self._header = header
        self._once = OncePer(CALLER_HEADERS_EVERY_S)  # per message template: a handful

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        held = self._once.due(template)
        if held is None or not logging.getLogger().isEnabledFor(logging.INFO):
            return False
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg = (
            f"a caller's {self._header} header was dropped: "
            + _FORMAT_FIELD.sub("(not logged)", template).replace("%%", "%")
            + "; said once a minute"
        )
        record.args = None
        if held:
            record.left_out = held
        return True


# The OpenTelemetry SDK's loggers that speak of a failing export, each a line a batch.
EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",  # failed, transient error, retrying
    "opentelemetry.sdk._shared_internal",  # the batch processor's queue full, spans dropped
)
EXPORT_TROUBLE_EVERY_S = 60.0


class ExportTrouble(logging.Filter):
    """The SDK's lines about a collector that cannot be reached, at most one a minute of each
    kind, saying how many were left out: with the collector away every batch logged (an
    observability probe: 17 lines in 40 s, about 1,000 an hour a process), while requests
    went on unaffected and spans resumed once it was back."""

    def __init__(self) -> None:
        super().__init__()
        self._once = OncePer(EXPORT_TROUBLE_EVERY_S)  # per message template

    def filter(self, record: logging.LogRecord) -> bool:
        held = self._once.due(str(record.msg))
        if held is None:
            return False
        if held:
            record.left_out = held  # lines like it in the last minute, not logged
        return True


# While a failure lasts, at most one line a key this often: under load an upstream that is
# down fails every request, and a warning each wrote hundreds of lines a second.
SUMMARY_S = 10.0
# A success ends an episode only this long after its last failure: with one replica of
# several failing, successes and failures interleave, and each success would otherwise end
# the episode and the next failure start another, two lines a failure.
QUIET_S = 1.0


@dataclasses.dataclass
class _Episode:
    fields: dict[str, Any]  # the first failure's, for the line that ends the episode
    started: float
    logged: float  # when the last line was written
    last_failure: float
    failures: int = 0  # in all
    unlogged: int = 0  # since the last line
    kinds: set[str] = dataclasses.field(default_factory=set)


class Episodes:
    """A warning that would repeat with every request, said once an episode.

    `failed(key, kind, **fields)` logs the first failure of a key at `level` (in the failing
    request's context, so with its trace id), and a kind the episode has not had yet (another
    status) at once too; repeats are counted and written as one line (`more_failures` since
    the last) at most every `summary_s`, from the next failure after it. `ended(key)`, called on a
    success, closes the key's episode once `quiet_s` have passed since its last failure, with
    one INFO line: how many failed and for how long.
    The metrics still count every failure; the log says when it started, how it goes and when
    it stopped. Used from one event loop (no lock); `ended` costs a dict check while no
    episode is open, as it runs on every successful call.
    """

    def __init__(
        self,
        log: logging.Logger,
        message: str,
        summary_s: float = SUMMARY_S,
        quiet_s: float = QUIET_S,
        clock: Callable[[], float] = time.monotonic,
        level: int = logging.WARNING,
    ) -> None:
        self._log = log
        self._message = message
        self._level = level
        self._summary_s = summary_s
        self._quiet_s = quiet_s
        self._clock = clock
        self._open: dict[Hashable, _Episode] = {}

    def failed(
        self, key: Hashable, kind: str, exc: BaseException | None = None, **fields: Any
    ) -> None:
        """`exc`: its traceback goes with the lines written at once (not the summaries)."""
        now = self._clock()
        episode = self._open.get(key)
        if episode is None:
            episode = self._open[key] = _Episode(fields, now, now, now)
        episode.failures += 1
        episode.last_failure = now
        if kind not in episode.kinds:
            episode.kinds.add(kind)
            episode.logged = now
            self._log.log(self._level, self._message, extra=fields, exc_info=exc)
        elif now - episode.logged >= self._summary_s:
            repeats = episode.unlogged + 1
            episode.unlogged = 0
            episode.logged = now
            self._log.log(
                self._level,
                self._message,
                extra={
                    **fields,
                    "more_failures": repeats,
                    "since_s": round(now - episode.started, 1),
                },
            )
        else:
            episode.unlogged += 1

    def ended(self, key: Hashable) -> None:
        if not self._open:
            return
        episode = self._open.get(key)
        if episode is None:
            return
        now = self._clock()
        if now - episode.last_failure < self._quiet_s:
            return
        del self._open[key]
        self._log.info(
            f"{self._message}: over",
            extra={
                **episode.fields,
                "failures": episode.failures,
                "lasted_s": round(now - episode.started, 1),
            },
        )

    def open(self) -> int:
        """Keys failing now (for tests and stats)."""
        return len(self._open)
