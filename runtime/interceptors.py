"""Behaviour every service RPC gets (readiness gate, tracing, metrics), wrapped in once.

Not grpc.aio interceptors: an interceptor is awaited on every call and must build a new
method handler each time, which on these machines cost a visible share of a hop whose own
work is tens of microseconds. Instead a service registers its handlers through
`WrappingRegistrar`, which wraps each method's behaviour once, at start-up; a call then
pays only for what the wrappers do.

Health, reflection and the KServe v2 liveness/readiness probes (`INFRA_METHOD_PREFIXES`) get
none of the service's wrappers: probes must answer while a service is starting or draining,
and tracing them would drown the traces that matter. They get the registrar's `infra`
wrappers instead: the peer check for reflection and the KServe probes (a caller the service
does not serve learns nothing), and a bound per client on reflection's streams, which any
caller can open (`StreamCap`; the health port bounds its watches the same way). Health
itself answers any caller, as Kubernetes' probes and the gateways' health checks need.

Responses that are a single message (unary and client-streaming RPCs) go through `wrap`;
response streams (server and bidirectional streaming) through `wrap_stream`, whose
behaviour is an async generator, so a wrapper sees the stream from its first message to its
end, cancellation included.

Requests are decoded here too, not by grpc. grpc turns a request its deserializer cannot
parse (corrupt bytes, a string field that is not UTF-8) into UNKNOWN "Unexpected <class
DecodeError>" and logs an ERROR with a traceback, for what is the client's mistake. So every
method, the probes included, is registered with no request deserializer (grpc hands over the
raw bytes) and `decoding` parses them inside the behaviour, innermost, under the wrappers: a
message that does not parse ends the RPC with INVALID_ARGUMENT and a short message, counted
in `hopline_undecodable_requests_total` and logged as one warning without a traceback (at most
one a second per method; the counter has them all). A request stream is decoded message by
message, the same way. The innermost step also ends a call the host's shortage failed (a
thread that could not start, memory, file descriptors, disk) with UNAVAILABLE, retryable,
where grpc would answer UNKNOWN with a traceback (`shortage_refusal`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from time import monotonic
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from hopline.observability import metrics
from hopline.observability.logs import Episodes
from hopline.runtime.errors import TRACE_ID_METADATA, host_shortage, shortage_message

log = logging.getLogger("hopline.runtime.requests")

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
    """Wraps a method's behaviour; returning None leaves it as it is.

    The behaviour a wrapper gets takes the request as raw bytes (a request stream: an async
    iterator of them): decoding happens under every wrapper, so that an undecodable request
    is gated and traced like any other.
    """

    def wrap(self, method: str, inner: Behaviour) -> Behaviour | None:
        return None

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour | None:
        return None


class StreamCap(RpcWrapper):
    """At most `per_client` response streams of the methods it wraps open at once from one
    client address, then RESOURCE_EXHAUSTED; callers `exempt` says are the port's own (its
    TLS peers) are not counted. Reflection's stream answers callers without a key, and the
    health port's watches any caller at all; each open stream holds 14-20 KB of the server's
    memory (a security probe: one client's 8,000-14,000 watches took a gateway from 80 to
    239 MB). Counted per client: a bound shared by every caller let anyone who filled it
    refuse everyone else. Never on a port's health watches, which gateways keep (runtime/
    server.py says why)."""

    def __init__(self, per_client: int, exempt: Callable[[Context], bool] | None = None) -> None:
        self.per_client = per_client
        self.exempt = exempt
        self.open: dict[str, int] = {}  # client address -> streams open; none kept at 0

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        if not inspect.isasyncgenfunction(inner):  # it writes with context.write
            writing: Behaviour = inner  # type: ignore[assignment]

            async def capped_writing(request: Any, context: Context) -> Any:
                client = await self._admit(context)
                try:
                    return await writing(request, context)
                finally:
                    self._release(client)

            return capped_writing  # type: ignore[return-value]

        async def capped(request: Any, context: Context) -> AsyncIterator[Any]:
            client = await self._admit(context)
            try:
                async for reply in inner(request, context):
                    yield reply
            finally:
                self._release(client)

        return capped

    async def _admit(self, context: Context) -> str | None:
        if self.exempt is not None and self.exempt(context):
            return None
        client = client_address(context.peer() or "")
        held = self.open.get(client, 0)
        if held >= self.per_client:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{held} health watches and reflection streams are open from your address, "
                f"the most one client keeps ({self.per_client}): close the ones not in use",
            )
        self.open[client] = held + 1
        return client

    def _release(self, client: str | None) -> None:
        if client is None:
            return
        left = self.open[client] - 1
        if left:
            self.open[client] = left
        else:
            del self.open[client]


def client_address(peer: str) -> str:
    """A caller's address without its port: `ipv4:10.0.0.7:51234` -> `ipv4:10.0.0.7`,
    `ipv6:%5B::1%5D:51234` -> `ipv6:%5B::1%5D`; a Unix socket's peer as it is."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


_KINDS: tuple[tuple[str, bool, Any], ...] = (
    ("unary_unary", False, grpc.unary_unary_rpc_method_handler),
    ("stream_unary", False, grpc.stream_unary_rpc_method_handler),
    ("unary_stream", True, grpc.unary_stream_rpc_method_handler),
    ("stream_stream", True, grpc.stream_stream_rpc_method_handler),
)


def wrap_handler(
    method: str,
    handler: Handler,
    wrappers: Sequence[RpcWrapper],
    infra: Sequence[RpcWrapper] = (),
) -> Handler:
    """`handler` with `wrappers` applied, the first one outermost, decoding its requests itself.

    Infra methods (health, reflection, the KServe probes) get `infra` instead of `wrappers`.
    """
    if method.startswith(INFRA_METHOD_PREFIXES):
        wrappers = infra
    for kind, streams, build in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is None:
            continue
        deserializer = handler.request_deserializer
        if deserializer is not None:
            behaviour = decoding(method, deserializer, behaviour, kind)
        return build(  # type: ignore[no-any-return]
            wrap_behaviour(method, behaviour, streams, wrappers),
            request_deserializer=None,  # raw bytes: `decoding` parses them
            response_serializer=handler.response_serializer,
        )
    return handler


def wrap_behaviour(
    method: str, behaviour: Any, streams: bool, wrappers: Sequence[RpcWrapper]
) -> Any:
    """`behaviour` under `wrappers`, the first one outermost (also for in-process calls)."""
    for wrapper in reversed(wrappers):
        wrapped = (
            wrapper.wrap_stream(method, behaviour) if streams else wrapper.wrap(method, behaviour)
        )
        behaviour = wrapped or behaviour
    return behaviour


# -- request decoding -------------------------------------------------------------------------

Deserializer = Callable[[bytes], Any]
WARN_EVERY_S = 1.0  # undecodable requests of one method logged at most this often
UNDECODABLE = "undecodable"  # one kind, whatever the reason: a new reason waits its turn
REASON_CHARS = 120


class _Refusals:
    """One method's undecodable requests: the counter, and a warning at most once a second
    (an episode that never ends: `more_failures` says how many since the last line)."""

    def __init__(self, method: str, expected: str) -> None:
        self.method = method
        service, _, rpc = method.lstrip("/").rpartition("/")
        self.counter = metrics.UNDECODABLE_REQUESTS.labels(service, rpc)
        self.message = f"the request is not a valid {expected}"
        self.said = Episodes(
            log, "undecodable request refused", summary_s=WARN_EVERY_S, clock=lambda: monotonic()
        )

    def count(self, exc: Exception) -> str:
        """Counts and logs one refusal; returns the message for the client."""
        self.counter.inc()
        reason = _reason(exc)
        self.said.failed(self.method, UNDECODABLE, method=self.method, reason=reason)
        return f"{self.message}: {reason}" if reason else self.message


def _reason(exc: Exception) -> str:
    """What was wrong, short: protobuf's "Error parsing message with type 'X': why" -> why."""
    text = str(exc).rpartition("': ")[2].strip() or type(exc).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "\u2026"


def _expected(deserializer: Deserializer, method: str) -> str:
    """The request message's full name, from `Message.FromString` (else the method's name)."""
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", None)
    return name if isinstance(name, str) else f"request for {method}"


def trace_trailer() -> tuple[tuple[str, str], ...]:
    """The trace id trailer every failed call carries; it also tells a client that a server
    answered (decoding runs under the tracing wrapper, so its refusals are traced)."""
    from hopline.observability.tracing import current_trace_id  # it imports this module

    return ((TRACE_ID_METADATA, current_trace_id()),)


class Undecodable(Exception):
    """A streamed request that does not parse, raised where the handler reads it: a handler
    may answer what it read before it (gateway/streaming.py); the stream then ends
    INVALID_ARGUMENT with `message` (the wrapper aborts with it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# The host running short (threads, memory, file descriptors, disk) fails calls while it lasts:
# said once an episode per method, with what ran out.
_SHORTAGES = Episodes(log, "call refused UNAVAILABLE: the host is out of a resource")


def shortage_refusal(method: str, exc: BaseException) -> str | None:
    """The status message for a call `exc` ended, when `exc` is the host's shortage
    (runtime/errors.py:host_shortage), logged once an episode; None for any other failure."""
    short_of = host_shortage(exc)
    if short_of is None:
        return None
    _SHORTAGES.failed(method, short_of, method=method, short_of=short_of, error=str(exc))
    return shortage_message(short_of)


async def _served(method: str, exc: Exception, context: Context) -> None:
    """Ends the call UNAVAILABLE when `exc` is the host's shortage; returns otherwise."""
    message = shortage_refusal(method, exc)
    if message is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message, trace_trailer())


def decoding(method: str, deserializer: Deserializer, behaviour: Any, kind: str) -> Any:
    """`behaviour` taking raw request bytes: each request is parsed with `deserializer`, and
    one that does not parse is refused with INVALID_ARGUMENT (see the module docstring)."""
    refusals = _Refusals(method, _expected(deserializer, method))

    async def refuse(context: Context, exc: Exception) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusals.count(exc), trace_trailer())
        raise AssertionError("abort returned")  # pragma: no cover: abort always raises

    async def each(raw: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
        async for data in raw:
            try:
                request = deserializer(data)
            except Exception as exc:  # any failure to parse client bytes is the client's
                raise Undecodable(refusals.count(exc)) from None
            yield request

    # A stream handler that writes its replies with context.write (health's Watch) is a
    # coroutine, awaited as a unary one is, and stays one.
    writes = kind == "unary_stream" and not inspect.isasyncgenfunction(behaviour)
    if kind == "unary_unary" or writes:

        async def unary_unary(data: bytes, context: Context) -> Any:
            try:
                request = deserializer(data)
            except Exception as exc:
                await refuse(context, exc)
            try:
                return await behaviour(request, context)
            except Exception as exc:
                await _served(method, exc, context)
                raise

        return unary_unary
    if kind == "unary_stream":

        async def unary_stream(data: bytes, context: Context) -> AsyncIterator[Any]:
            try:
                request = deserializer(data)
            except Exception as exc:
                await refuse(context, exc)
            try:
                async for reply in behaviour(request, context):
                    yield reply
            except Exception as exc:
                await _served(method, exc, context)
                raise

        return unary_stream
    if kind == "stream_unary":

        async def stream_unary(raw: AsyncIterator[bytes], context: Context) -> Any:
            try:
                return await behaviour(each(raw, context), context)
            except Undecodable as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message, trace_trailer())
            except Exception as exc:
                await _served(method, exc, context)
                raise

        return stream_unary

    async def stream_stream(raw: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
        try:
            async for reply in behaviour(each(raw, context), context):
                yield reply
        except Undecodable as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message, trace_trailer())
        except Exception as exc:
            await _served(method, exc, context)
            raise

    return stream_stream


class _WrappedGeneric(_GenericHandler):
    """A generic handler whose methods are wrapped on first use, then served from a table."""

    def __init__(
        self,
        inner: grpc.GenericRpcHandler[Any, Any],
        wrappers: Sequence[RpcWrapper],
        infra: Sequence[RpcWrapper],
    ) -> None:
        self._inner = inner
        self._wrappers = wrappers
        self._infra = infra
        self._table: dict[str, Handler | None] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = handler_call_details.method
        try:
            return self._table[method]
        except KeyError:
            handler = self._inner.service(handler_call_details)
            wrapped = (
                None
                if handler is None
                else wrap_handler(method, handler, self._wrappers, self._infra)
            )
            self._table[method] = wrapped
            return wrapped


class WrappingRegistrar:
    """Stands in for the grpc.aio server while a service registers its servicers.

    Generated `add_*Servicer_to_server` functions call both methods below with the same
    handlers; each gets the wrapped handlers, so whichever lookup grpc uses finds them.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        wrappers: Sequence[RpcWrapper],
        infra: Sequence[RpcWrapper] = (),
    ) -> None:
        self._server = server
        self._wrappers = tuple(wrappers)
        self._infra = tuple(infra)

    def add_generic_rpc_handlers(
        self, handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_WrappedGeneric(h, self._wrappers, self._infra) for h in handlers)
        )

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, Handler]
    ) -> None:
        self._server.add_registered_method_handlers(  # type: ignore[attr-defined]
            service_name,
            {
                name: wrap_handler(f"/{service_name}/{name}", handler, self._wrappers, self._infra)
                for name, handler in method_handlers.items()
            },
        )
