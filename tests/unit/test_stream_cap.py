"""Open health watches are bounded (runtime/interceptors.py:StreamCap): any caller may watch,
with no key, and a security probe's one client opened 8,000-14,000 watches in seconds, each
holding 14-20 KB of the gateway's memory. An in-process grpc.aio server with health
registered as runtime/server.py registers it."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from hopline.runtime.interceptors import StreamCap, WrappingRegistrar

WATCH = health_pb2.HealthCheckRequest(service="")


async def _watches() -> tuple[list[int], grpc.StatusCode | None, str, int]:
    server = grpc.aio.server()
    cap = StreamCap(2)
    health = HealthServicer()
    registrar = WrappingRegistrar(server, (), infra=(cap,))
    health_pb2_grpc.add_HealthServicer_to_server(health, cast(grpc.aio.Server, registrar))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            open_: list[Any] = [stub.Watch(WATCH) for _ in range(2)]
            firsts = [(await call.read()).status for call in open_]
            third = stub.Watch(WATCH)
            refused: grpc.StatusCode | None = None
            details = ""
            try:
                await third.read()
            except grpc.aio.AioRpcError as err:
                refused, details = err.code(), err.details() or ""
            open_[0].cancel()
            for _ in range(100):  # the server sees the cancellation a moment later
                if cap.open < 2:
                    break
                await asyncio.sleep(0.01)
            fourth = stub.Watch(WATCH)
            served = (await fourth.read()).status
            for call in (open_[1], fourth):
                call.cancel()
            return firsts, refused, details, served
    finally:
        await server.stop(0)


def test_health_watches_past_the_cap_are_refused_and_a_closed_one_frees_its_place() -> None:
    opened, refused, details, served = asyncio.run(_watches())
    assert opened == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the most it keeps (2)" in details
    assert served == health_pb2.HealthCheckResponse.SERVING
