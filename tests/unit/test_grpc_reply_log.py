"""grpc.aio's ERROR with a traceback for a reply it could not send (its call had ended: the
client's deadline passed as the reply went, or the client cancelled a stream it did not read)
becomes one INFO line a minute per method (observability/logs.py:RepliesAfterTheCallEnded).

The records are logged here as grpc 1.85's server logs them (logger, message, traceback): the
race with a client's deadline cannot be made on demand; helpers' probes found the lines in
internal services under short deadlines and in the gateway for a cancelled PredictStream.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from hopline.observability.logs import (
    GRPC_AIO_SERVER_LOGGER,
    LogFormat,
    LogLevel,
    RepliesAfterTheCallEnded,
    setup_logging,
)


class ExecuteBatchError(Exception):
    """grpc's own (grpc._cython.cygrpc.ExecuteBatchError) is not importable by name."""


def grpc_logs(method: str) -> None:
    try:
        raise ExecuteBatchError('Failed "execute_batch": (<grpc._cython.cygrpc.SendMessage')
    except ExecuteBatchError as err:
        logging.getLogger(GRPC_AIO_SERVER_LOGGER).exception(
            "%s raised in core by servicer method [%s]", type(err).__name__, method
        )


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    """What setup_logging's handler writes, with a fresh filter."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    grpc_logger = logging.getLogger(GRPC_AIO_SERVER_LOGGER)
    filters = grpc_logger.filters[:]
    grpc_logger.filters = [f for f in filters if not isinstance(f, RepliesAfterTheCallEnded)]
    setup_logging("tokenizer", LogLevel.INFO, LogFormat.JSON)
    written = io.StringIO()
    (handler,) = root.handlers
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(written)
    try:
        yield written
    finally:
        root.handlers[:], grpc_logger.filters = handlers, filters
        root.setLevel(level)


def test_a_reply_after_the_call_ended_is_one_info_line_a_minute_per_method(
    logs: io.StringIO,
) -> None:
    tokenize = "/hopline.tokenizer.v1.TokenizerService/Tokenize"
    for _ in range(3):
        grpc_logs(tokenize)
    grpc_logs("/hopline.inference.v1.InferenceService/Infer")
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    assert [(d["level"], d["method"]) for d in lines] == [
        ("info", tokenize),
        ("info", "/hopline.inference.v1.InferenceService/Infer"),
    ]
    assert all("exc" not in d for d in lines)
    assert lines[0]["msg"].startswith("a reply was not sent: its call had ended first")


def test_other_errors_grpc_logs_are_left_as_they_are(logs: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger(GRPC_AIO_SERVER_LOGGER).exception(
            "Unexpected [ValueError] raised by servicer method [/x.Y/Z]"
        )
    (line,) = [json.loads(line) for line in logs.getvalue().splitlines()]
    assert line["level"] == "error"
    assert "ValueError: boom" in line["exc"]


def test_setting_logging_up_again_adds_the_filter_once() -> None:
    grpc_logger = logging.getLogger(GRPC_AIO_SERVER_LOGGER)
    root = logging.getLogger()
    handlers, level, filters = root.handlers[:], root.level, grpc_logger.filters[:]
    try:
        for _ in range(3):
            setup_logging("gateway")
        ours = [f for f in grpc_logger.filters if isinstance(f, RepliesAfterTheCallEnded)]
        assert len(ours) == 1
    finally:
        root.handlers[:], grpc_logger.filters = handlers, filters
        root.setLevel(level)
