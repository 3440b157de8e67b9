"""One caller of a gRPC target blocks on gRPC's synchronous stub, on a thread of its own
(bench/load.py says why); more callers, and targets without a blocking call, stay on the
event loop. Against a real gRPC server on a loopback port."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from hopline.bench.load import closed_loop
from hopline.bench.targets import ECHO, EchoTarget

MISSING = b"missing"


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == MISSING:
        context.abort(grpc.StatusCode.NOT_FOUND, "no such text")
    return request


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    service, method = ECHO.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_unary_rpc_method_handler(_echo)}
    )
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(None)


async def _window(
    target: EchoTarget, concurrency: int, payloads: list[bytes]
) -> tuple[list[str], list[bytes], set[int]]:
    """Statuses, replies and the threads the calls ran on, over 0.3 s."""
    threads: set[int] = set()
    blocking = target.blocking() if concurrency == 1 else None

    def send_blocking(payload: bytes) -> bytes:
        threads.add(threading.get_ident())
        assert blocking is not None
        return blocking(payload)

    async def send(payload: bytes) -> bytes:
        threads.add(threading.get_ident())
        reply: bytes = await target.call(payload)
        return reply

    run = await closed_loop(
        send,
        lambda i: payloads[i % len(payloads)],
        concurrency=concurrency,
        duration_s=0.3,
        blocking=send_blocking if blocking is not None else None,
    )
    return run.statuses, run.responses, threads


def test_one_caller_blocks_on_a_thread_of_its_own_and_opens_no_aio_channel(
    server: str,
) -> None:
    async def main() -> tuple[list[str], list[bytes], set[int], int, int]:
        target = EchoTarget(server)
        try:
            statuses, replies, threads = await _window(target, 1, [b"a", MISSING])
            return statuses, replies, threads, threading.get_ident(), len(target._aio)
        finally:
            await target.close()

    statuses, replies, threads, loop_thread, aio_channels = asyncio.run(main())
    assert threads
    assert loop_thread not in threads
    assert aio_channels == 0  # no grpc.aio poller to hand the blocking stub's replies over
    # A failed call is counted by its gRPC status, as on grpc.aio; the others replied.
    assert set(statuses) == {"OK", "NOT_FOUND"}
    assert statuses.count("OK") == len(replies)
    assert set(replies) == {b"a"}


def test_more_callers_stay_on_the_event_loop(server: str) -> None:
    async def main() -> tuple[list[str], set[int], int]:
        target = EchoTarget(server)
        try:
            statuses, _, threads = await _window(target, 2, [b"a", MISSING])
            return statuses, threads, threading.get_ident()
        finally:
            await target.close()

    statuses, threads, loop_thread = asyncio.run(main())
    assert threads == {loop_thread}
    assert set(statuses) == {"OK", "NOT_FOUND"}


def test_a_cancelled_blocking_window_stops_after_its_current_call(server: str) -> None:
    """Ctrl-C during a window: the caller's thread ends, not the window's remaining seconds."""

    async def main() -> int:
        target = EchoTarget(server)
        blocking = target.blocking()
        calls = 0

        def counted(payload: bytes) -> bytes:
            nonlocal calls
            calls += 1
            return blocking(payload)

        window = asyncio.ensure_future(
            closed_loop(target.call, lambda i: b"a", concurrency=1, duration_s=30, blocking=counted)
        )
        await asyncio.sleep(0.2)
        window.cancel()
        with pytest.raises(asyncio.CancelledError):
            await window
        await asyncio.sleep(0.2)  # the thread's current call ends; no new one starts
        after = calls
        await asyncio.sleep(0.3)
        await target.close()
        return calls - after

    assert asyncio.run(main()) == 0
