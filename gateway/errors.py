"""Refusals the gateway makes itself, before any hop.

Every status error derives from hopline.runtime.errors.StatusError, whose docstring draws the
whole hierarchy; this module holds only the gateway's own request checks' error.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from hopline.observability.tracing import current_trace_id
from hopline.runtime.errors import TRACE_ID_METADATA, StatusError


class RequestError(StatusError):
    """A request the gateway refuses before any hop: bad text, unknown model, bad top_k."""


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: StatusError) -> NoReturn:
    """End the RPC with `err`'s status and message, its trace id in the trailing metadata."""
    await context.abort(err.code, err.message, ((TRACE_ID_METADATA, current_trace_id()),))
    raise AssertionError("abort returned")  # pragma: no cover: abort always raises
