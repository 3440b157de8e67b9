"""A replica that hangs (a stopped process, a frozen node) loses its connection from the
gateway within the keepalive ping's timeout, so its calls fail and are retried elsewhere
and new ones go to the replicas that answer. gRPC core (1.85) times keepalive pings out
with `grpc.http2.ping_timeout_ms` (60 s by default), not `grpc.keepalive_timeout_ms`, so the
gateway's channels held a hung replica's connection for about 80 s (found by stopping one
of two inference replicas under load).

A real server process, stopped with SIGSTOP, and a channel with the gateway's options but
for the time between pings (10 s there, 1 s here, so the test takes seconds)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hopline.gateway.upstream import KEEPALIVE_TIMEOUT_MS, channel_options
from hopline.runtime.ports import free_ports

SERVER = """
import asyncio, sys, grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer
async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    server.add_insecure_port(sys.argv[1])
    await server.start()
    print("up", flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""
PING_EVERY_MS = 1_000


async def seconds_until_dropped(address: str, hang: Callable[[], None]) -> float:
    """How long a channel with the gateway's options keeps a READY connection to a peer
    after `hang` stops it."""
    options = dict(channel_options(0, 4 << 20))
    options["grpc.keepalive_time_ms"] = PING_EVERY_MS
    async with grpc.aio.insecure_channel(address, options=list(options.items())) as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        hang()
        hung = time.monotonic()
        while channel.get_state() == grpc.ChannelConnectivity.READY:
            assert time.monotonic() - hung < 60, "the hung peer's connection was kept"
            await asyncio.sleep(0.1)
        return time.monotonic() - hung


def test_a_hung_peers_connection_is_dropped_within_the_ping_timeout() -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "up"
        took_s = asyncio.run(
            seconds_until_dropped(address, lambda: os.kill(server.pid, signal.SIGSTOP))
        )
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.communicate()
    # A ping within a second of the stop, its answer awaited for the timeout, and a margin
    # for a loaded machine; far from gRPC's own 60 s.
    assert took_s < PING_EVERY_MS / 1e3 + KEEPALIVE_TIMEOUT_MS / 1e3 + 10, took_s
