"""The readiness gate during a drain: new calls are refused with UNAVAILABLE, and the drain
waits for the calls it had let in (unary and streaming) before the server is stopped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import grpc
import pytest
from servicer_context import Aborted, AbortingContext

from hopline.runtime.interceptors import Context
from hopline.runtime.server import DRAINING, NOT_READY, ReadinessGate


def context() -> Context:
    return AbortingContext().as_context()


async def refused(call: Any) -> tuple[grpc.StatusCode, str] | None:
    aborting = AbortingContext()
    with pytest.raises(Aborted):
        await call(aborting)
    return aborting.aborted


def test_draining_refuses_new_calls_and_waits_for_admitted_ones() -> None:
    async def scenario() -> None:
        gate = ReadinessGate()
        release = asyncio.Event()

        async def slow(request: str, context: Any) -> str:
            await release.wait()
            return f"done {request}"

        behaviour = gate.wrap("/hopline.test.v1.T/Slow", slow)
        assert await refused(lambda c: behaviour("early", c)) == (
            grpc.StatusCode.UNAVAILABLE,
            NOT_READY,
        )
        assert await gate.settle(0.0)  # a refused call was never in flight
        gate.ready = True
        running = asyncio.ensure_future(behaviour("admitted", context()))
        await asyncio.sleep(0)
        gate.draining = True
        assert await refused(lambda c: behaviour("late", c)) == (
            grpc.StatusCode.UNAVAILABLE,
            DRAINING,
        )
        assert not await gate.settle(0.05)  # the admitted call still runs
        release.set()
        assert await gate.settle(1.0)
        assert await running == "done admitted"

    asyncio.run(scenario())


def test_a_stream_is_in_flight_until_it_ends() -> None:
    async def scenario() -> None:
        gate = ReadinessGate()
        gate.ready = True
        release = asyncio.Event()

        async def replies(request: str, context: Any) -> AsyncIterator[str]:
            yield "first"
            await release.wait()
            yield "last"

        stream = gate.wrap_stream("/hopline.test.v1.T/Stream", replies)("r", context())
        assert await anext(stream) == "first"
        assert not await gate.settle(0.05)
        release.set()
        assert [reply async for reply in stream] == ["last"]
        assert await gate.settle(1.0)

        # A stream its caller abandons half-way is no longer in flight once it is closed.
        release.clear()
        abandoned = cast(
            AsyncGenerator[Any, None],
            gate.wrap_stream("/hopline.test.v1.T/Stream", replies)("r", context()),
        )
        assert await anext(abandoned) == "first"
        await abandoned.aclose()
        assert await gate.settle(1.0)

    asyncio.run(scenario())
