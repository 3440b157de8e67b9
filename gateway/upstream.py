"""Pools of channels to one upstream service, and hop calls that name the hop on failure.

gRPC shares one TCP connection between channels whose arguments are identical, so each
channel of a pool gets its own index argument and a local subchannel pool: N channels are
N connections, and concurrent calls are not serialised behind one HTTP/2 connection.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from hopline.observability import metrics, schema
from hopline.observability.tracing import outgoing_metadata, tracer

StubT = TypeVar("StubT")


class HopError(Exception):
    """An upstream call failed; carries the status the gateway should return."""

    def __init__(self, hop: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.hop = hop
        self.code = code
        self.message = message


def channel_options(index: int, max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.use_local_subchannel_pool", 1),
        ("hopline.channel_index", index),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Fail fast while a peer restarts instead of backing off for up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


class Upstream(Generic[StubT]):
    def __init__(
        self,
        hop: str,
        target: str,
        stub: Callable[[grpc.aio.Channel], StubT],
        size: int,
        max_message_bytes: int,
    ) -> None:
        self.hop = hop
        self.target = target
        self.channels = [
            grpc.aio.insecure_channel(target, options=channel_options(i, max_message_bytes))
            for i in range(max(1, size))
        ]
        self._stubs = [stub(c) for c in self.channels]
        self._next = itertools.cycle(self._stubs)

    def stub(self) -> StubT:
        return next(self._next)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close(grace=None)


def _hop_error(hop: str, target: str, err: grpc.aio.AioRpcError) -> HopError:
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return HopError(hop, code, f"{hop} service unavailable at {target}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HopError(hop, code, f"deadline exceeded waiting for the {hop} service")
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    ):
        return HopError(hop, code, f"{hop}: {details}")
    return HopError(hop, grpc.StatusCode.INTERNAL, f"{hop} failed with {code.name}: {details}")


async def call_hop(
    hop: str,
    target: str,
    rpc: Callable[..., Awaitable[Any]],
    request: Any,
    timeout_s: float,
    timings: dict[str, float],
) -> Any:
    """One traced upstream call; records its wall time and maps failures to HopError."""
    started = time.perf_counter()
    with tracer().start_as_current_span(
        hop,
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "server.address": target, schema.HOP: hop},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        code = grpc.StatusCode.OK
        try:
            if timeout_s <= 0:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                raise HopError(hop, code, f"deadline exceeded before calling the {hop} service")
            return await rpc(request, timeout=timeout_s, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as err:
            code = err.code()
            span.set_status(Status(StatusCode.ERROR, code.name))
            raise _hop_error(hop, target, err) from None
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            elapsed = time.perf_counter() - started
            timings[hop] = elapsed * 1e3
            metrics.HOP_DURATION.labels(hop, code.name).observe(elapsed, metrics.trace_exemplar())
