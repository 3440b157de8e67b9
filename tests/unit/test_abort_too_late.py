"""The gateway sends no status once the client's deadline has passed (gateway/errors.py:
abort): grpc's send then fails and logs an ERROR traceback per call ("ExecuteBatchError raised
in core by servicer method [.../Predict]" after "the deadline leaves -0 ms", seen by two
helpers' probes with short client deadlines). A stand-in context: the race with the client's
timer cannot be made on demand with real processes."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from hopline.gateway.errors import TOO_LATE_S, RequestError, abort


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.aborted: list[grpc.StatusCode] = []

    def time_remaining(self) -> float | None:
        return self.remaining

    async def abort(self, code: grpc.StatusCode, details: str, trailing: Any) -> None:
        self.aborted.append(code)
        raise grpc.aio.AbortError


def run_abort(remaining: float | None) -> tuple[type[BaseException], list[grpc.StatusCode]]:
    context = Context(remaining)
    err = RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline leaves -0 ms")
    try:
        asyncio.run(abort(context, err))  # type: ignore[arg-type]  # a stand-in context
    except (asyncio.CancelledError, grpc.aio.AbortError) as exc:
        return type(exc), context.aborted
    raise AssertionError("abort returned")


@pytest.mark.parametrize("remaining", [0.0, -0.5, TOO_LATE_S / 2])
def test_no_status_is_sent_once_the_clients_deadline_has_passed(remaining: float) -> None:
    raised, aborted = run_abort(remaining)
    assert raised is asyncio.CancelledError
    assert aborted == []


@pytest.mark.parametrize("remaining", [None, 0.5])
def test_a_status_is_sent_while_the_client_waits(remaining: float | None) -> None:
    raised, aborted = run_abort(remaining)
    assert raised is grpc.aio.AbortError
    assert aborted == [grpc.StatusCode.DEADLINE_EXCEEDED]
