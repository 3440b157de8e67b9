"""The event loop a service runs on (`HOPLINE_EVENT_LOOP`): uvloop by default, asyncio's own
on request or where uvloop is not installed.

A hop whose servicer works for microseconds is mostly event-loop and gRPC plumbing, so the
loop is a visible share of it. Measured on this project's 2-core EPYC VM, asyncio's loop vs
uvloop in every service, meshes side by side with alternated rounds (`hopline bench`, c=1: 4
rounds of 5 s, c=32: 4 rounds of 6 s): five-process miss c=1 p50 19.60 -> 18.02 ms (the
tokenize and postprocess hops 2.59 -> 2.27 and 2.57 -> 2.30 ms), c=32 139 -> 153 rps;
co-located miss c=1 12.96 -> 12.69 ms and c=32 159 vs 158.5 rps (the model's time dominates
both), co-located exact repeats c=32 1469 -> 1658 rps. grpc.aio runs on any asyncio loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("hopline.runtime.event_loop")

T = TypeVar("T")


class EventLoop(enum.StrEnum):
    UVLOOP = "uvloop"  # libuv's loop (the uvloop package): the default
    ASYNCIO = "asyncio"  # the standard library's


def loop_factory(kind: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What builds a `kind` loop (None: asyncio's default); uvloop asked for and missing
    falls back to asyncio's, said in one log line."""
    if kind is EventLoop.ASYNCIO:
        return None
    try:
        import uvloop
    except ImportError:
        log.warning(
            "uvloop is not installed; running on asyncio's event loop",
            extra={"asked": kind.value, "runs": EventLoop.ASYNCIO.value},
        )
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def running() -> str:
    """The loop that runs this coroutine's thread, by library ('uvloop' or 'asyncio'): what
    runs, not what was asked (a missing uvloop falls back to asyncio's)."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


def run(main: Callable[[], Coroutine[Any, Any, T]], kind: EventLoop) -> T:
    """`asyncio.run(main())` on a `kind` loop."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main())
