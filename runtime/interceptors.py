"""Behaviour every service RPC gets (readiness gate, tracing, metrics), wrapped in once.

Not grpc.aio interceptors: an interceptor is awaited on every call and must build a new
method handler each time, which on these machines cost a visible share of a hop whose own
work is tens of microseconds. Instead a service registers its handlers through
`WrappingRegistrar`, which wraps each method's behaviour once, at start-up; a call then
pays only for what the wrappers do.

Health, reflection and the KServe v2 liveness/readiness probes pass through untouched: probes
must answer while a service is starting or draining, and tracing them would drown the traces
that matter. (Health and reflection are registered on the server directly, not through the
registrar; the KServe probes are filtered by name.)

Responses that are a single message (unary and client-streaming RPCs) go through `wrap`;
response streams (server and bidirectional streaming) through `wrap_stream`, whose
behaviour is an async generator, so a wrapper sees the stream from its first message to its
end, cancellation included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

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
if TYPE_CHECKING:  # generic only in the stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    _GenericHandler = grpc.GenericRpcHandler[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    _GenericHandler = grpc.GenericRpcHandler


class RpcWrapper:
    """Wraps a method's behaviour; returning None leaves it as it is."""

    def wrap(self, method: str, inner: Behaviour) -> Behaviour | None:
        return None

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour | None:
        return None


_KINDS: tuple[tuple[str, bool, Any], ...] = (
    ("unary_unary", False, grpc.unary_unary_rpc_method_handler),
    ("stream_unary", False, grpc.stream_unary_rpc_method_handler),
    ("unary_stream", True, grpc.unary_stream_rpc_method_handler),
    ("stream_stream", True, grpc.stream_stream_rpc_method_handler),
)


def wrap_handler(method: str, handler: Handler, wrappers: Sequence[RpcWrapper]) -> Handler:
    """`handler` with `wrappers` applied, the first one outermost."""
    if method.startswith(INFRA_METHOD_PREFIXES):
        return handler
    for kind, streams, build in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is None:
            continue
        for wrapper in reversed(wrappers):
            wrapped = (
                wrapper.wrap_stream(method, behaviour)
                if streams
                else wrapper.wrap(method, behaviour)
            )
            behaviour = wrapped or behaviour
        return build(  # type: ignore[no-any-return]
            behaviour,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


class _WrappedGeneric(_GenericHandler):
    """A generic handler whose methods are wrapped on first use, then served from a table."""

    def __init__(
        self, inner: grpc.GenericRpcHandler[Any, Any], wrappers: Sequence[RpcWrapper]
    ) -> None:
        self._inner = inner
        self._wrappers = wrappers
        self._table: dict[str, Handler | None] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = handler_call_details.method
        try:
            return self._table[method]
        except KeyError:
            handler = self._inner.service(handler_call_details)
            wrapped = None if handler is None else wrap_handler(method, handler, self._wrappers)
            self._table[method] = wrapped
            return wrapped


class WrappingRegistrar:
    """Stands in for the grpc.aio server while a service registers its servicers.

    Generated `add_*Servicer_to_server` functions call both methods below with the same
    handlers; each gets the wrapped handlers, so whichever lookup grpc uses finds them.
    """

    def __init__(self, server: grpc.aio.Server, wrappers: Sequence[RpcWrapper]) -> None:
        self._server = server
        self._wrappers = tuple(wrappers)

    def add_generic_rpc_handlers(
        self, handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_WrappedGeneric(h, self._wrappers) for h in handlers)
        )

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, Handler]
    ) -> None:
        self._server.add_registered_method_handlers(  # type: ignore[attr-defined]
            service_name,
            {
                name: wrap_handler(f"/{service_name}/{name}", handler, self._wrappers)
                for name, handler in method_handlers.items()
            },
        )
