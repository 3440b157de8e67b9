"""Pools of channels to one upstream service, and hop calls that name the hop on failure.

gRPC shares one TCP connection between channels whose arguments are identical, so each
channel of a pool gets its own index argument and a local subchannel pool: N channels are
N connections, and concurrent calls are not serialised behind one HTTP/2 connection.

GatewayUpstreams holds the four pools the gateway calls. GatewayService builds them from its
config unless it is given them, which is how tests/unit runs the orchestration in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from hopline.observability import metrics, schema
from hopline.observability.tracing import outgoing_metadata, tracer
from hopline.protos.hopline.cache.v1 import cache_pb2_grpc
from hopline.protos.hopline.inference.v1 import inference_pb2_grpc
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2_grpc
from hopline.runtime.errors import StatusError

if TYPE_CHECKING:
    from hopline.gateway.service import GatewayConfig

StubT = TypeVar("StubT")
StubT_co = TypeVar("StubT_co", covariant=True)


class HopError(StatusError):
    """An upstream call failed; carries the status the gateway should return."""

    def __init__(self, hop: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.hop = hop


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


class Pool(Protocol[StubT_co]):
    """What the gateway needs of an upstream: Upstream is the real one, tests use stand-ins."""

    @property
    def target(self) -> str:
        """The address it dials, for error messages and spans."""

    def stub(self) -> StubT_co:
        """A stub for the next call."""

    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class GatewayUpstreams:
    """The four services the gateway calls.

    GatewayService connects to the addresses in its config unless it is handed these, so the
    orchestration can run in-process against stand-ins.
    """

    tokenizer: Pool[tokenizer_pb2_grpc.TokenizerServiceAsyncStub]
    cache: Pool[cache_pb2_grpc.CacheServiceAsyncStub]
    inference: Pool[inference_pb2_grpc.InferenceServiceAsyncStub]
    postprocess: Pool[postprocess_pb2_grpc.PostprocessServiceAsyncStub]

    @classmethod
    def connect(cls, config: GatewayConfig) -> GatewayUpstreams:
        n, size = config.channels_per_upstream, config.max_message_bytes
        return cls(
            tokenizer=Upstream(
                schema.SPAN_TOKENIZE,
                config.tokenizer_addr,
                tokenizer_pb2_grpc.TokenizerServiceStub,
                n,
                size,
            ),
            cache=Upstream(
                schema.SPAN_CACHE_LOOKUP,
                config.cache_addr,
                cache_pb2_grpc.CacheServiceStub,
                n,
                size,
            ),
            inference=Upstream(
                schema.SPAN_INFERENCE,
                config.inference_addr,
                inference_pb2_grpc.InferenceServiceStub,
                n,
                size,
            ),
            postprocess=Upstream(
                schema.SPAN_POSTPROCESS,
                config.postprocess_addr,
                postprocess_pb2_grpc.PostprocessServiceStub,
                n,
                size,
            ),
        )

    async def close(self) -> None:
        for upstream in (self.tokenizer, self.cache, self.inference, self.postprocess):
            await upstream.close()


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
