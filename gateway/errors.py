"""Refusals the gateway makes itself, before any hop.

Every status error derives from hopline.runtime.errors.StatusError, whose docstring draws the
whole hierarchy; this module holds only the gateway's own request checks' error.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn, cast

import grpc

from hopline.observability.tracing import current_trace_id
from hopline.runtime.errors import TRACE_ID_METADATA, StatusError

# A status sent with less than this left of the client's deadline would reach it after its own
# timer ended the call: none is sent (see `abort`).
TOO_LATE_S = 0.002


class RequestError(StatusError):
    """A request the gateway refuses before any hop: bad text, unknown model, bad top_k."""


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: StatusError) -> NoReturn:
    """End the RPC with `err`'s status and message, its trace id in the trailing metadata.

    Not once the client's deadline has passed (or all but): its own timer ends the call with
    DEADLINE_EXCEEDED, and a status sent then fails inside grpc, which logs an ERROR with a
    traceback for each (helpers' probes with short client deadlines: a few in every couple of
    thousand calls). The RPC ends as cancelled instead; its span and metrics say
    DEADLINE_EXCEEDED (observability/tracing.py:_cancelled_code)."""
    remaining = cast("float | None", context.time_remaining())
    if remaining is not None and remaining <= TOO_LATE_S:
        raise asyncio.CancelledError
    await context.abort(err.code, err.message, ((TRACE_ID_METADATA, current_trace_id()),))
    raise AssertionError("abort returned")  # pragma: no cover: abort always raises
