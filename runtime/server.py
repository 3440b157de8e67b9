"""The runtime every service shares: grpc.aio server, health, reflection, SIGTERM drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any, Protocol, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from hopline.observability.metrics import start_metrics_server
from hopline.observability.tracing import ServerTracing, shutdown_tracing
from hopline.runtime.config import ServerConfig
from hopline.runtime.interceptors import (
    Behaviour,
    Context,
    RpcWrapper,
    StreamBehaviour,
    WrappingRegistrar,
)

log = logging.getLogger("hopline.runtime.server")


class Service(Protocol):
    """What a hopline service plugs into the runtime."""

    @property
    def service_names(self) -> tuple[str, ...]:
        """Fully qualified gRPC service names it registers, for health and reflection.

        One process may serve several APIs on one port (the gateway: its own and KServe v2).
        """

    def register(self, server: grpc.aio.Server) -> None: ...

    async def start(self) -> None:
        """Load models/stores and warm up; the service reports SERVING only after this."""

    async def stop(self) -> None:
        """Release resources after in-flight RPCs have finished."""


NOT_READY = "starting up: not ready yet, retry"


class ReadinessGate(RpcWrapper):
    """Refuses service RPCs with UNAVAILABLE until start-up has finished.

    The port is bound before models load (so health probes can see NOT_SERVING); without
    this gate an early caller would get answers from a half-loaded service.
    """

    def __init__(self) -> None:
        self.ready = False

    def wrap(self, method: str, inner: Behaviour) -> Behaviour:
        async def gated(request: Any, context: Context) -> Any:
            if not self.ready:
                await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
            return await inner(request, context)

        return gated

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        async def gated(request: Any, context: Context) -> AsyncIterator[Any]:
            if not self.ready:
                await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
            async for reply in inner(request, context):
                yield reply

        return gated


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Let clients keep idle connections alive with pings without being sent GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
        # grpc turns SO_REUSEPORT on by default: a second server on a taken port would then
        # start fine and silently receive part of the first one's connections. Fail instead.
        ("grpc.so_reuseport", 0),
    ]


async def serve(service: Service, config: ServerConfig) -> int:
    """Run `service` until SIGTERM/SIGINT, then drain. Returns the process exit code."""
    gate = ReadinessGate()
    server = grpc.aio.server(options=server_options(config.max_message_bytes))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    # Each method's handler is wrapped once here, not per call (see hopline.runtime.interceptors).
    registrar = WrappingRegistrar(server, [gate, ServerTracing(config.test_delay_ms)])
    service.register(cast(grpc.aio.Server, registrar))
    reflection.enable_server_reflection(
        [
            *service.service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    for name in ("", *service.service_names):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    try:
        port = server.add_insecure_port(config.listen)
    except RuntimeError as exc:
        log.error("cannot bind", extra={"listen": config.listen, "error": str(exc)})
        return 2
    await server.start()
    log.info("listening", extra={"listen": config.listen, "port": port})
    start_metrics_server(config.metrics_host, config.metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    starting = asyncio.ensure_future(service.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        failure = starting.exception()
        if failure is not None:
            log.error("start-up failed", extra={"error": f"{type(failure).__name__}: {failure}"})
            await server.stop(0)
            return 1
        gate.ready = True
        for name in ("", *service.service_names):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"services": list(service.service_names)})
        await stopping
    else:
        starting.cancel()

    # Drain: report NOT_SERVING first (balancers and probes move away), keep accepting for a
    # moment, then refuse new RPCs and give in-flight ones the grace period to finish.
    log.info("draining", extra={"delay_s": config.drain_delay_s, "grace_s": config.drain_grace_s})
    await health.enter_graceful_shutdown()
    await asyncio.sleep(config.drain_delay_s)
    drain = getattr(service, "drain", None)  # optional: end streams held open indefinitely
    if drain is not None:
        await drain()
    await server.stop(config.drain_grace_s)
    await service.stop()
    shutdown_tracing()
    log.info("stopped")
    return 0
