"""A base for server interceptors that wrap the services' own RPCs, unary and streaming.

Health, reflection and the KServe v2 liveness/readiness probes pass through untouched: probes
must answer while a service is starting or draining, and tracing them would drown the traces
that matter.

grpc.aio hands an interceptor the method handler, not the call: wrapping means building a new
handler of the same cardinality around the servicer's behaviour. Responses that are a single
message (unary and client-streaming RPCs) go through `wrap`; response streams (server and
bidirectional streaming) through `wrap_stream`, whose behaviour is an async generator, so a
wrapper sees the stream from its first message to its end, cancellation included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

INFRA_METHOD_PREFIXES = (
    "/grpc.health.",
    "/grpc.reflection.",
    # The KServe v2 probes (gateway): Triton-style clients ask them while a server starts.
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
)
Context = grpc.aio.ServicerContext[Any, Any]
Behaviour = Callable[[Any, Context], Awaitable[Any]]
StreamBehaviour = Callable[[Any, Context], AsyncIterator[Any]]


class RpcInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def wrap(
        self, method: str, details: grpc.HandlerCallDetails, inner: Behaviour
    ) -> Behaviour | None:
        """What to run instead of a single-response RPC's `inner`; None leaves it alone."""
        return None

    def wrap_stream(
        self, method: str, details: grpc.HandlerCallDetails, inner: StreamBehaviour
    ) -> StreamBehaviour | None:
        """What to run instead of a response-streaming RPC's `inner`; None leaves it alone."""
        return None

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(INFRA_METHOD_PREFIXES):
            return handler
        codecs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        kinds: tuple[tuple[str, Any, Any], ...] = (
            ("unary_unary", self.wrap, grpc.unary_unary_rpc_method_handler),
            ("stream_unary", self.wrap, grpc.stream_unary_rpc_method_handler),
            ("unary_stream", self.wrap_stream, grpc.unary_stream_rpc_method_handler),
            ("stream_stream", self.wrap_stream, grpc.stream_stream_rpc_method_handler),
        )
        for kind, wrap, build in kinds:
            inner = getattr(handler, kind)
            if inner is not None:
                wrapped = wrap(method, handler_call_details, inner)
                return handler if wrapped is None else build(wrapped, **codecs)
        return handler
