"""A miss's stage as the gateway calls it, with a short way for co-located services.

Every hop goes through `call_hop` (its client span, the trace context in metadata, timing,
HopError) over the stage's batching (gateway/stage_batching.py; a remote service's stage
only) and, for a co-located service, the in-process stub and the server side's wrappers:
about ten layers of coroutine the event loop steps through at every suspension, on the cores
the model runs on. A request whose trace is not recorded gets no span from any of them, so
for that request `StageHop` calls a co-located servicer through runtime/inproc.py:DirectCall,
keeping what the layers give it: the readiness gate, the deadline, the hop's timing and its
`hopline_hop_duration_seconds`, the service's RPC metrics, and its failures as the same
HopError. A recorded request and a remote service take the layered path, so traces and
`hopline trace report` read as before.

Measured (docs/performance.md, "Co-located hops without their layers"): 40-110 us less a
hop at the gateway, at one caller and at 32, on the 2-core VM; c=32 throughput level.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry import trace

from hopline.gateway.stage_batching import BatchedStage
from hopline.gateway.upstream import (
    HOP_FAILURES,
    CoLocated,
    HopError,
    Pool,
    call_hop,
    hop_failure,
)
from hopline.observability import metrics
from hopline.runtime.inproc import INPROC, DirectCall

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class StageHop(Generic[Req, Rep]):
    """One stage (`rpc`, a unary method of the pool's service) of a miss: `await hop(request,
    timeout_s, timings)` answers its reply or raises HopError, as `call_hop` does."""

    def __init__(
        self,
        hop: str,
        pool: Pool[Any],
        stage: BatchedStage[Req, Rep] | None,
        rpc: str,
    ) -> None:
        self.hop = hop
        self._pool = pool
        self._stage = stage
        self._rpc = rpc
        self._direct: DirectCall | None = pool.direct(rpc) if isinstance(pool, CoLocated) else None

    def _layered(self) -> Callable[..., Awaitable[Rep]]:
        if self._stage is not None:
            return self._stage
        method: Callable[..., Awaitable[Rep]] = getattr(self._pool.stub(), self._rpc)
        return method

    async def __call__(self, request: Req, timeout_s: float, timings: dict[str, float]) -> Rep:
        direct = self._direct
        # A refusing gate (a co-located service starting or draining) fails either path the
        # same way, so the direct one checks it once, inside DirectCall.
        if direct is not None and not trace.get_current_span().is_recording():
            return await self._call_direct(direct, request, timeout_s, timings)
        return await call_hop(  # type: ignore[no-any-return]
            self.hop, self._pool.target, self._layered(), request, timeout_s, timings
        )

    async def _call_direct(
        self, direct: DirectCall, request: Req, timeout_s: float, timings: dict[str, float]
    ) -> Rep:
        """`call_hop`'s timing, metric and failures around a DirectCall, with no span (the
        trace is not recorded) and no metadata (the servicer runs in this context)."""
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if timeout_s <= 0:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                detail = f"deadline exceeded before calling the {self.hop} service"
                raise HopError(self.hop, code, detail, INPROC)
            reply: Rep = await direct(request, timeout=timeout_s)
            HOP_FAILURES.ended((self.hop, INPROC))
            return reply
        except grpc.aio.AioRpcError as err:
            code = err.code()
            raise hop_failure(self.hop, INPROC, err) from None
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            elapsed = time.perf_counter() - started
            timings[self.hop] = elapsed * 1e3
            metrics.hop_duration(self.hop, code.name).observe(elapsed)
