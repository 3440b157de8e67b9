"""runtime/inproc.py:within_deadline: a co-located call's deadline, armed only if it waits.

The coroutines here are small real ones (futures, sleeps, exceptions); the timer is counted
by wrapping asyncio.timeout, which within_deadline uses to enforce the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from hopline.runtime.inproc import within_deadline


@pytest.fixture
def timers(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The delays of the asyncio.timeout contexts within_deadline opens."""
    opened: list[float | None] = []
    real: Callable[[float | None], AbstractAsyncContextManager[Any]] = asyncio.timeout

    def counting(delay: float | None) -> AbstractAsyncContextManager[Any]:
        opened.append(delay)
        return real(delay)

    monkeypatch.setattr(asyncio, "timeout", counting)
    return opened


def _in(seconds: float) -> float:
    return time.monotonic() + seconds


def test_a_call_that_never_waits_answers_with_no_timer(timers: list[float | None]) -> None:
    async def answer() -> str:
        return "tokens"

    async def scenario() -> str:
        return await within_deadline(answer(), _in(5.0))  # type: ignore[no-any-return]

    assert asyncio.run(scenario()) == "tokens"
    assert timers == []


def test_a_call_that_fails_at_once_raises_its_own_error(timers: list[float | None]) -> None:
    async def refuse() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(within_deadline(refuse(), _in(5.0)))
    assert timers == []


def test_a_waiting_call_gets_what_it_waits_for_under_one_timer(
    timers: list[float | None],
) -> None:
    async def scenario() -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[int] = loop.create_future()
        second: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, first.set_result, 20)
        loop.call_later(0.02, second.set_exception, KeyError("gone"))

        async def run() -> tuple[int, str]:
            value = await first
            await asyncio.sleep(0)  # a bare yield to the loop, as a task allows
            try:
                await second
            except KeyError as exc:
                return value + 1, str(exc)
            return value, ""

        return await within_deadline(run(), _in(5.0))  # type: ignore[no-any-return]

    assert asyncio.run(scenario()) == (21, "'gone'")
    assert len(timers) == 1
    assert timers[0] is not None
    assert 4.9 < timers[0] <= 5.0


def test_a_wait_past_the_deadline_times_out_and_the_call_is_cancelled(
    timers: list[float | None],
) -> None:
    seen: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def scenario() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await within_deadline(slow(), _in(0.05))
        return time.monotonic() - started

    waited = asyncio.run(scenario())
    assert seen == ["cancelled"]
    assert 0.04 <= waited < 2.0
    assert len(timers) == 1


def test_no_deadline_waits_as_long_as_the_call(timers: list[float | None]) -> None:
    async def slowish() -> str:
        await asyncio.sleep(0.02)
        return "done"

    assert asyncio.run(within_deadline(slowish(), None)) == "done"
    assert timers == []


def test_the_callers_cancellation_reaches_the_call() -> None:
    seen: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(5)
        finally:
            seen.append("left")

    async def scenario() -> bool:
        task = asyncio.ensure_future(within_deadline(slow(), _in(10.0)))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(scenario())
    assert seen == ["left"]
