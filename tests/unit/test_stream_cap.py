"""Open health watches are bounded per client address (runtime/interceptors.py:StreamCap):
any caller may watch, with no key, and a security probe's one client opened 8,000-14,000
watches in seconds, each holding 14-20 KB of the gateway's memory. Per client, not for the
whole port: a bound every caller shared let one who filled it fail the health watch of every
gateway that connected meanwhile, which then took the service for down (an operator's probe).
An in-process grpc.aio server with health registered as runtime/server.py registers it; the
two clients are the same machine over IPv4 and IPv6 loopback."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from hopline.runtime.interceptors import StreamCap, WrappingRegistrar, client_address

WATCH = health_pb2.HealthCheckRequest(service="")
SERVING = health_pb2.HealthCheckResponse.SERVING


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


async def _watches(exempt: bool) -> dict[str, Any]:
    server = grpc.aio.server()
    cap = StreamCap(2, exempt=(lambda context: "127.0.0.1" in context.peer()) if exempt else None)
    health = HealthServicer()
    registrar = WrappingRegistrar(server, (), infra=(cap,))
    health_pb2_grpc.add_HealthServicer_to_server(health, cast(grpc.aio.Server, registrar))
    port = server.add_insecure_port("[::]:0")
    await server.start()
    await health.set("", SERVING)
    seen: dict[str, Any] = {}
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as v4,
            grpc.aio.insecure_channel(f"[::1]:{port}") as v6,
        ):
            flood, other = health_pb2_grpc.HealthStub(v4), health_pb2_grpc.HealthStub(v6)
            held = [flood.Watch(WATCH) for _ in range(3)]
            seen["flood"] = []
            for call in held:
                try:
                    seen["flood"].append((await call.read()).status)
                except grpc.aio.AioRpcError as err:
                    seen["flood"].append(err.code())
                    seen["said"] = err.details()
            # Another client's watch is served whatever the first holds.
            watcher = other.Watch(WATCH)
            seen["other"] = (await watcher.read()).status
            seen["open"] = dict(cap.open)
            for call in (*held, watcher):
                call.cancel()
            for _ in range(100):  # the server sees the cancellations a moment later
                if not cap.open:
                    break
                await asyncio.sleep(0.01)
            seen["after"] = dict(cap.open)
    finally:
        await server.stop(0)
    return seen


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here: one client only")
def test_one_clients_watches_past_the_cap_are_refused_and_another_client_is_served() -> None:
    seen = asyncio.run(_watches(exempt=False))
    assert sorted(map(str, seen["flood"])) == sorted(
        map(str, [SERVING, SERVING, grpc.StatusCode.RESOURCE_EXHAUSTED])
    )
    assert "the most one client keeps (2)" in seen["said"]
    assert seen["other"] == SERVING
    assert seen["open"] == {"ipv4:127.0.0.1": 2, "ipv6:%5B::1%5D": 1}
    assert seen["after"] == {}  # closed watches free their places; no address kept at 0


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here: one client only")
def test_the_ports_own_peers_are_not_counted() -> None:
    seen = asyncio.run(_watches(exempt=True))
    assert seen["flood"] == [SERVING, SERVING, SERVING]
    assert seen["open"] == {"ipv6:%5B::1%5D": 1}


def test_a_client_is_its_address_without_the_port() -> None:
    assert client_address("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert client_address("ipv6:%5B::1%5D:51234") == "ipv6:%5B::1%5D"  # as gRPC writes it
    assert client_address("unix:/run/hopline.sock") == "unix:/run/hopline.sock"
