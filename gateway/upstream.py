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
import logging
import re
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

log = logging.getLogger("hopline.gateway.upstream")

StubT = TypeVar("StubT")
StubT_co = TypeVar("StubT_co", covariant=True)


class HopError(StatusError):
    """An upstream call failed; carries the status the gateway should return.

    `.message` is for the caller: it names the hop, never the address it dials (that, and
    the upstream's own details, go to the log and the hop's span: `.target`, `.details`).
    """

    def __init__(
        self, hop: str, code: grpc.StatusCode, message: str, target: str = "", details: str = ""
    ) -> None:
        super().__init__(code, message)
        self.hop = hop
        self.target = target
        self.details = details


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


# Addresses grpc core writes into its details ("ipv4:127.0.0.1:8011: Connection refused").
_ADDRESS = re.compile(
    r"\b(?:ipv4|ipv6|unix|unix-abstract|dns|vsock):[^\s,;]+"
    r"|\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?"
)
DETAILS_CHARS = 300  # an upstream's details passed on to the caller, at most


def caller_details(details: str, target: str) -> str:
    """An upstream's status details fit for the caller: no address in them, and short."""
    text = details.replace(target, "<address>") if target else details
    text = _ADDRESS.sub("<address>", text)
    return text if len(text) <= DETAILS_CHARS else text[: DETAILS_CHARS - 1] + "\u2026"


def _hop_error(hop: str, target: str, err: grpc.aio.AioRpcError) -> HopError:
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        # grpc's details here are about the connection (and name the address): logged, not
        # returned. The caller can only retry.
        return HopError(hop, code, f"{hop} service unavailable", target, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HopError(
            hop, code, f"deadline exceeded waiting for the {hop} service", target, details
        )
    shown = caller_details(details, target)
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    ):
        return HopError(hop, code, f"{hop}: {shown}", target, details)
    return HopError(
        hop, grpc.StatusCode.INTERNAL, f"{hop} failed with {code.name}: {shown}", target, details
    )


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
                raise HopError(
                    hop, code, f"deadline exceeded before calling the {hop} service", target
                )
            return await rpc(request, timeout=timeout_s, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as err:
            code = err.code()
            failure = _hop_error(hop, target, err)
            # The span has the address (server.address) and the upstream's own details.
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {failure.details}"))
            if failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                log.warning(
                    "hop failed",
                    extra={
                        "hop": hop,
                        "target": target,
                        "status": code.name,
                        "details": failure.details,
                    },
                )
            raise failure from None
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            elapsed = time.perf_counter() - started
            timings[hop] = elapsed * 1e3
            metrics.HOP_DURATION.labels(hop, code.name).observe(elapsed, metrics.trace_exemplar())
