"""A base for server interceptors that wrap the services' own unary RPCs.

Health, reflection and the KServe v2 liveness/readiness probes pass through untouched: probes
must answer while a service is starting or draining, and tracing them would drown the traces
that matter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

INFRA_METHOD_PREFIXES = (
    "/grpc.health.",
    "/grpc.reflection.",
    # The KServe v2 probes (gateway): Triton-style clients ask them while a server starts.
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
)
Behaviour = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


class UnaryInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def wrap(
        self, method: str, details: grpc.HandlerCallDetails, inner: Behaviour
    ) -> Behaviour | None:
        """The behaviour to run instead of `inner`, or None to leave the RPC alone."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if (
            handler is None
            or handler.unary_unary is None
            or method.startswith(INFRA_METHOD_PREFIXES)
        ):
            return handler
        wrapped = self.wrap(method, handler_call_details, handler.unary_unary)  # type: ignore[arg-type]
        if wrapped is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
