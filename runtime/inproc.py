"""Co-location by address: a service's servicer running inside its caller's process.

`HOPLINE_<NAME>_ADDR=inproc` on the gateway runs that service in the gateway's process and
calls it through the service's own generated stub over `InProcessChannel`, as gRPC's
in-process transports do in other languages: the caller's code is the same for both
placements (a stub, a request, a timeout, metadata; AioRpcError on failure), so hop spans,
hop timings, retries' absence and error mapping read the same in a trace.

What a call skips: serialisation, HTTP/2 framing, the socket and the server's thread hop.
What it keeps: the server side's wrappers (readiness gate, server span parented on the
caller's `traceparent`, the RPC's metrics), the deadline (the servicer sees it as
`time_remaining()`, and a call that overruns it ends DEADLINE_EXCEEDED), and aborts as
statuses. Requests and replies are handed over as objects, not copies: neither side may
change a message after handing it over (no hopline code does; replies were already shared
between coalesced requests).

The service's start-up (`start`) and shutdown (`stop`) run in the caller's: the gateway is
not SERVING until its co-located services are, and stops them after its own drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Generator, Mapping, Sequence
from typing import Any, NoReturn, cast

import grpc

from hopline.observability.tracing import RpcMeter, ServerTracing
from hopline.runtime import config as cfg
from hopline.runtime.interceptors import (
    Context,
    Handler,
    RpcWrapper,
    shortage_refusal,
    wrap_behaviour,
)
from hopline.runtime.server import ReadinessGate, Service
from hopline.runtime.service_table import INPROC, ServiceSpec

log = logging.getLogger("hopline.runtime.inproc")

__all__ = ["INPROC", "DirectCall", "InProcessChannel", "InProcessService"]


class _Aborted(Exception):
    """What `context.abort` raises in-process (grpc.aio's AbortError is an Exception too)."""


class _Context:
    """The part of grpc.aio.ServicerContext hopline's servicers and wrappers use."""

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]], timeout: float | None):
        self._metadata = tuple(metadata)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._code: grpc.StatusCode | None = None
        self._details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def peer(self) -> str:
        return INPROC

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        self._code, self._details = code, details
        raise _Aborted(details)

    def failure(self, exc: BaseException) -> grpc.aio.AioRpcError:
        """The AioRpcError a remote caller would have got for `exc` ending the RPC."""
        if isinstance(exc, _Aborted) and self._code is not None:
            return _rpc_error(self._code, self._details)
        if isinstance(exc, TimeoutError):
            return _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if (shortage := shortage_refusal("in-process", exc)) is not None:
            return _rpc_error(grpc.StatusCode.UNAVAILABLE, shortage)
        # What grpc's server answers for an exception a servicer let escape.
        log.error("servicer raised", exc_info=exc)
        return _rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)!r}: {exc}")


class _Resumed:
    """Awaits the rest of a coroutine that has already run to its first suspension, as
    `await` would have (PEP 380's delegation: values sent in, exceptions thrown in, the
    result out), so that `within_deadline` can start it before arming a timer."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self._coro = coro
        self._pending = pending  # what the coroutine yielded to the event loop

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, pending = self._coro, self._pending
        while True:
            try:
                sent = yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a task's cancellation, thrown into the wait
                try:
                    pending = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as done:
                    return done.value


async def within_deadline(coro: Coroutine[Any, Any, Any], deadline: float | None) -> Any:
    """`await coro`, raising TimeoutError once `deadline` (time.monotonic) passes while it
    waits. The timer is armed only if the coroutine suspends: the tokenizer and postprocess
    answer without waiting, and an asyncio.timeout per call (a timer handle, two look-ups of
    the running loop, each a getpid) was a tenth of a direct call's own cost at 32 callers
    (py-spy); only the model's run waits. Like asyncio.timeout, a call that never waits
    finishes even past its deadline."""
    try:
        pending = coro.send(None)
    except StopIteration as done:
        return done.value
    resumed = _Resumed(coro, pending)
    if deadline is None:
        return await resumed
    async with asyncio.timeout(deadline - time.monotonic()):
        return await resumed


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


class _UnaryUnary:
    def __init__(self, behaviour: Any) -> None:
        self._behaviour = behaviour

    async def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (a stub's signature: the call's deadline)
        metadata: Sequence[tuple[str, str | bytes]] | None = None,
        **_: Any,
    ) -> Any:
        context = _Context(metadata or (), timeout)
        try:
            return await within_deadline(
                self._behaviour(request, cast(Context, context)), context.deadline
            )
        except (_Aborted, TimeoutError, Exception) as exc:
            raise context.failure(exc) from None


class _StreamCall:
    """A server stream's call object: iterate it for the replies; cancel() ends it."""

    def __init__(self, behaviour: Any, request: Any, context: _Context) -> None:
        self._replies: AsyncIterator[Any] = behaviour(request, cast(Context, context))
        self._context = context
        self._closing: asyncio.Future[None] | None = None

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for reply in self._replies:
                yield reply
        except (_Aborted, Exception) as exc:
            raise self._context.failure(exc) from None

    def cancel(self) -> bool:
        self._closing = asyncio.ensure_future(cast(Any, self._replies).aclose())
        return True


class DirectCall:
    """One unary method of a co-located service with its server-side wrappers folded into
    this one step: the readiness gate (refusal and the drain's count), the deadline, the
    RPC's metrics, statuses as AioRpcError. What it leaves out is the server span, so a
    caller uses it only where none would be recorded (gateway/direct_hop.py:StageHop, for a
    request whose trace is not recorded that finds its stage free); the call runs in the
    caller's context, as a co-located call whose trace is not recorded already does."""

    def __init__(self, method: str, behaviour: Any, gate: ReadinessGate) -> None:
        self._behaviour = behaviour
        self._gate = gate
        self._meter = RpcMeter(method)

    async def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (a stub's signature: the call's deadline)
        metadata: Sequence[tuple[str, str | bytes]] | None = None,
        **_: Any,
    ) -> Any:
        context = _Context(metadata or (), timeout)
        refusal = self._gate.refusal()
        if refusal is not None:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, refusal)
        task = self._gate.enter()
        self._meter.enter()
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await within_deadline(
                self._behaviour(request, cast(Context, context)), context.deadline
            )
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except (_Aborted, TimeoutError, Exception) as exc:
            failure = context.failure(exc)
            code = failure.code()
            raise failure from None
        finally:
            self._meter.leave(code, started)
            self._gate.leave(task)


class _UnaryStream:
    def __init__(self, behaviour: Any) -> None:
        self._behaviour = behaviour

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str | bytes]] | None = None,
        **_: Any,
    ) -> _StreamCall:
        return _StreamCall(self._behaviour, request, _Context(metadata or (), timeout))


class InProcessChannel:
    """Stands in for a grpc.aio.Channel under a generated stub: methods by their full path."""

    def __init__(self, methods: Mapping[str, Handler], wrappers: Sequence[RpcWrapper]) -> None:
        self._methods = methods
        self._wrappers = wrappers

    def _behaviour(self, method: str, kind: str) -> Any:
        handler = self._methods.get(method)
        behaviour = None if handler is None else getattr(handler, kind)
        if behaviour is None:
            raise ValueError(f"{method} is not a {kind} method of the co-located service")
        return wrap_behaviour(method, behaviour, kind.endswith("stream"), self._wrappers)

    def unary_unary(self, method: str, *_: Any, **__: Any) -> _UnaryUnary:
        return _UnaryUnary(self._behaviour(method, "unary_unary"))

    def unary_stream(self, method: str, *_: Any, **__: Any) -> _UnaryStream:
        return _UnaryStream(self._behaviour(method, "unary_stream"))

    async def close(self, grace: float | None = None) -> None:
        return None


class _Registrar:
    """Stands in for the server while a servicer registers: keeps its method handlers."""

    def __init__(self) -> None:
        self.methods: dict[str, Handler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        return None  # generated code registers the same handlers by name below

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, Handler]
    ) -> None:
        for name, handler in method_handlers.items():
            self.methods[f"/{service_name}/{name}"] = handler


class InProcessService:
    """One service's servicer in this process, with the server-side wrappers it would have."""

    def __init__(self, name: str, servicer: Service, test_delay_ms: float = 0.0) -> None:
        self.name = name
        self.servicer = servicer
        self._gate = ReadinessGate()
        registrar = _Registrar()
        servicer.register(cast(grpc.aio.Server, registrar))
        wrappers = [self._gate, ServerTracing(test_delay_ms)]
        self.channel = InProcessChannel(registrar.methods, wrappers)
        self._methods = registrar.methods
        self._test_delay_ms = test_delay_ms

    def direct(self, rpc: str) -> DirectCall | None:
        """The unary method named `rpc` (`Tokenize`) as a DirectCall; None where every call
        must take the stub's path: a test's delay (HOPLINE_TEST_DELAY_MS) is the span
        wrapper's to add."""
        if self._test_delay_ms:
            return None
        paths = [path for path in self._methods if path.rpartition("/")[2] == rpc]
        if len(paths) != 1:
            raise ValueError(f"{self.name} has no unary method {rpc!r}")
        behaviour = self._methods[paths[0]].unary_unary
        if behaviour is None:
            raise ValueError(f"{paths[0]} is not a unary method")
        return DirectCall(paths[0], behaviour, self._gate)

    @classmethod
    def load(cls, service: ServiceSpec) -> InProcessService:
        """The service the table names, configured from this process's HOPLINE_* variables."""
        config_cls, servicer_cls = service.load()
        config = cfg.load(config_cls, [], prog=f"{service.name} (in-process)")
        return cls(service.name, servicer_cls(config), config.test_delay_ms)

    async def start(self) -> None:
        started = time.monotonic()
        await self.servicer.start()
        self._gate.ready = True
        log.info(
            "co-located service serving",
            extra={"service": self.name, "start_s": round(time.monotonic() - started, 2)},
        )

    async def stop(self) -> None:
        self._gate.ready = False
        drain = getattr(self.servicer, "drain", None)  # optional, as in runtime.server.serve
        if drain is not None:
            await drain()
        await self.servicer.stop()
