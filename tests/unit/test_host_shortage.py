"""A call the host's shortage fails (a thread that could not start, memory, file descriptors,
disk) ends UNAVAILABLE with a message saying what ran out, on the wire and in process; any
other exception a servicer lets escape stays UNKNOWN, as gRPC answers it.

Real grpc.aio servers on loopback with the runtime's request decoding (runtime/interceptors.py:
wrap_handler), and the in-process channel co-located services are called through. The thread
limit itself is not reached here: `threading.Thread.start` is made to fail as CPython's does
under a pids limit ("can't start new thread"), and a real thread pool is asked for a thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest.mock import patch

import grpc
import pytest

from hopline.runtime.inproc import InProcessChannel
from hopline.runtime.interceptors import wrap_handler

SERVICE = "hopline.test.v1.Short"


def _no_thread(self: threading.Thread) -> None:
    raise RuntimeError("can't start new thread")


async def _needs_a_thread(request: bytes, context: Any) -> bytes:
    pool = ThreadPoolExecutor(max_workers=1)
    # Only this pool's thread fails to start: gRPC's own threads are already running.
    with patch.object(threading.Thread, "start", _no_thread):
        answer = asyncio.get_running_loop().run_in_executor(pool, bytes, request)
    return await answer


async def _out_of_fds(request: bytes, context: Any) -> bytes:
    raise OSError(errno.EMFILE, "Too many open files")


async def _bug(request: bytes, context: Any) -> bytes:
    raise ValueError("a servicer bug")


async def _streams_out_of_memory(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield request
    raise MemoryError


UNARY = {"Thread": _needs_a_thread, "Fds": _out_of_fds, "Bug": _bug}


def _handlers() -> dict[str, Any]:
    handlers: dict[str, Any] = {
        name: grpc.unary_unary_rpc_method_handler(behaviour, request_deserializer=bytes)
        for name, behaviour in UNARY.items()
    }
    handlers["Stream"] = grpc.unary_stream_rpc_method_handler(
        _streams_out_of_memory, request_deserializer=bytes
    )
    return {
        name: wrap_handler(f"/{SERVICE}/{name}", handler, ()) for name, handler in handlers.items()
    }


async def _call(channel: Any, method: str) -> tuple[grpc.StatusCode, str]:
    """`method` once on `channel` (a grpc.aio channel or the in-process one): its status."""
    try:
        if method == "Stream":
            async for _ in channel.unary_stream(f"/{SERVICE}/{method}", None, None)(
                b"x", timeout=10
            ):
                pass
        else:
            await channel.unary_unary(f"/{SERVICE}/{method}", None, None)(b"x", timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


async def _over_grpc(method: str) -> tuple[grpc.StatusCode, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _handlers()),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await _call(channel, method)
    finally:
        await server.stop(None)


async def _in_process(method: str) -> tuple[grpc.StatusCode, str]:
    unary = {
        f"/{SERVICE}/{name}": grpc.unary_unary_rpc_method_handler(behaviour)
        for name, behaviour in UNARY.items()
    }
    unary[f"/{SERVICE}/Stream"] = grpc.unary_stream_rpc_method_handler(_streams_out_of_memory)
    return await _call(InProcessChannel(unary, []), method)


CASES = [
    ("Thread", grpc.StatusCode.UNAVAILABLE, "out of threads"),
    ("Fds", grpc.StatusCode.UNAVAILABLE, "out of file descriptors"),
    ("Stream", grpc.StatusCode.UNAVAILABLE, "out of memory"),
    ("Bug", grpc.StatusCode.UNKNOWN, "a servicer bug"),
]


@pytest.mark.parametrize("transport", [_over_grpc, _in_process], ids=["grpc", "in_process"])
@pytest.mark.parametrize(("method", "expected", "says"), CASES)
def test_a_call_the_hosts_shortage_failed_is_retryable_and_says_what_ran_out(
    caplog: pytest.LogCaptureFixture,
    transport: Callable[[str], Coroutine[Any, Any, tuple[grpc.StatusCode, str]]],
    method: str,
    expected: grpc.StatusCode,
    says: str,
) -> None:
    with caplog.at_level(logging.WARNING, logger="hopline.runtime.requests"):
        code, details = asyncio.run(transport(method))

    assert (code, says in details) == (expected, True), details
    if expected == grpc.StatusCode.UNAVAILABLE:
        assert "retry" in details
        # The operator learns which limit, without a traceback per call.
        [line] = [r for r in caplog.records if "out of a resource" in r.getMessage()]
        assert line.exc_info is None
