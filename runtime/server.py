"""The runtime every service shares: grpc.aio server, health, reflection, SIGTERM drain."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator
from typing import Any, NoReturn, Protocol, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from hopline.observability.metrics import ProcessView, start_metrics_server
from hopline.observability.tracing import ServerTracing, shutdown_tracing
from hopline.runtime import collector, event_loop, grpc_io, reflection
from hopline.runtime.config import ServerConfig, SettingError, setting_of
from hopline.runtime.fd_limit import FdWatch, raise_soft_limit
from hopline.runtime.interceptors import (
    Behaviour,
    Context,
    RpcWrapper,
    StreamBehaviour,
    StreamCap,
    WrappingRegistrar,
    trace_trailer,
)
from hopline.runtime.parent import STOP_SIGNALS
from hopline.runtime.ports import port_problem
from hopline.runtime.service_table import SERVICES, ServiceName
from hopline.runtime.tls import (
    CERT_ENV,
    KEY_ENV,
    PeerCheck,
    TlsConfigError,
    TlsFiles,
    peer_check,
    server_credentials,
)
from hopline.runtime.workers import serve_own_metrics, strangers, worker_index

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

    # Optional, looked up with getattr: `begin_drain()` when SIGTERM arrives (a readiness probe
    # of the service's own API turns false with health), `async drain()` once the drain delay
    # is over (end streams held open indefinitely), `rpc_wrappers()` its own RpcWrappers,
    # inside the runtime's (the gateway's key check before a request is parsed).


NOT_READY = "starting up: not ready yet, retry"
DRAINING = "shutting down: retry on another replica"
CUT = (
    "shutting down: this call outlived the drain's grace (HOPLINE_DRAIN_GRACE_S) and was "
    "ended; retry on another replica"
)
# Reflection streams open at once from one client address on a service's port, and health
# watches on its plaintext health port (each 14-20 KB of memory; no gateway watches there:
# probes ask Check): a flood from one address stops at this, and fails no one else's.
MAX_INFRA_STREAMS = 64
CUT_WAIT_S = 1.0  # for the calls ended at the grace's end to send their status
REPLY_FLUSH_S = 0.05


class ReadinessGate(RpcWrapper):
    """Refuses service RPCs with UNAVAILABLE while starting up and while draining, and
    counts the ones in flight so a drain knows when they have finished.

    The port is bound before models load (so health probes can see NOT_SERVING); without
    this gate an early caller would get answers from a half-loaded service. While draining,
    the gate refuses new calls itself (see `_end_process` for why grpc's shutdown does not).
    """

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[Any]] = set()  # the admitted calls' handler tasks
        self._cutting = False

    def refusal(self) -> str | None:
        """Why a call is refused now (starting, draining), None when it is admitted."""
        if self.draining:
            return DRAINING
        return None if self.ready else NOT_READY

    def enter(self) -> asyncio.Task[Any] | None:
        """An admitted call starts (a drain waits for it): returns its task, for `leave` when
        it ends (asked once: on Python 3.11 `current_task` is Python, a visible share of a
        gateway's exact repeat)."""
        self._in_flight += 1
        self._idle.clear()
        if (task := asyncio.current_task()) is not None:
            self._tasks.add(task)
        return task

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()
        if task is not None:
            self._tasks.discard(task)

    async def cut(self) -> None:
        """End the calls still in flight when the drain's grace is over, each with CUT
        (UNAVAILABLE), where grpc's server stop ended them with its "Cancelling all calls"."""
        self._cutting = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CUT_WAIT_S)
            await asyncio.sleep(REPLY_FLUSH_S)

    async def ended(self, context: Context) -> None:
        """A call's task was cancelled: by `cut`, it ends with CUT; else (its caller gone)
        the cancel goes on."""
        if self._cutting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, CUT, trace_trailer())

    async def settle(self, timeout_s: float) -> bool:
        """Wait until no admitted RPC is in flight; False when `timeout_s` ran out first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def wrap(self, method: str, inner: Behaviour) -> Behaviour:
        async def gated(request: Any, context: Context) -> Any:
            refusal = self.refusal()
            if refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, refusal, trace_trailer())
            task = self.enter()
            try:
                return await inner(request, context)
            except asyncio.CancelledError:
                await self.ended(context)
                raise
            finally:
                self.leave(task)

        return gated

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        async def gated(request: Any, context: Context) -> AsyncIterator[Any]:
            refusal = self.refusal()
            if refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, refusal, trace_trailer())
            task = self.enter()
            try:
                async for reply in inner(request, context):
                    yield reply
            except asyncio.CancelledError:
                await self.ended(context)
                raise
            finally:
                self.leave(task)

        return gated


class FaultInjection(RpcWrapper):
    """TEST ONLY (HOPLINE_TEST_FAULT): every service RPC fails with one status, so a test can
    run a broken replica beside a healthy one. Health still answers SERVING: a replica that
    looks alive and answers errors is the case ejection is for."""

    def __init__(self, code_name: str) -> None:
        try:
            self.code = grpc.StatusCode[code_name.strip().upper()]
        except KeyError:
            known = ", ".join(c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK)
            raise SettingError(
                f"HOPLINE_TEST_FAULT={code_name!r} is no status code ({known})"
            ) from None

    def wrap(self, method: str, inner: Behaviour) -> Behaviour:
        async def failing(request: Any, context: Context) -> Any:
            await context.abort(self.code, "injected fault (HOPLINE_TEST_FAULT)")

        return failing

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        async def failing(request: Any, context: Context) -> AsyncIterator[Any]:
            replies: tuple[Any, ...] = ()  # an async generator, like what it replaces
            for reply in replies:
                yield reply
            await context.abort(self.code, "injected fault (HOPLINE_TEST_FAULT)")

        return failing


# The gateway's port, which any client reaches, bounds what gRPC core's defaults leave open
# (a hostile client's probe, co-located, a steady client at 20 rps beside each attack):
# - streams a connection holds at once: none advertised, 10 connections of 10,000 Predict
#   streams that sent headers only took the gateway from 595 to 1,564 MB and failed 201 of the
#   steady client's 2,160 calls (CANCELLED, DEADLINE_EXCEEDED); HTTP/2 rapid reset (HEADERS then
#   RST_STREAM, 36,000 a second on one connection) failed 374 of its 760. With 256 (Go's HTTP/2
#   server keeps 250): the streams past it reset (ENHANCE_YOUR_CALM), +55 MB, 0 failed in
#   both. A client past 256 calls on one connection waits in its own gRPC for a free stream; one
#   that holds more than 256 streams open at once (PredictStream) opens more connections.
# - keepalive: a client flooding PINGs while reading nothing kept the gateway at a core and
#   its connection open for good (the steady client's calls failed for the flood's length);
#   pinged every 10 s and given 5 s to answer, it was reset after 6 s (and with this port's
#   limits together, closed at once, the steady client unharmed); a peer that vanished
#   without closing is found the same way.
FRONT_DOOR_MAX_STREAMS_PER_CONNECTION = 256
FRONT_DOOR_LIMITS = [
    ("grpc.max_concurrent_streams", FRONT_DOOR_MAX_STREAMS_PER_CONNECTION),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def server_options(
    max_message_bytes: int,
    max_connection_age_s: float = 0.0,
    *,
    reuse_port: bool = False,
    front_door: bool = False,
) -> list[tuple[str, int]]:
    """`max_connection_age_s`: 0 keeps a connection for as long as its client does.
    `reuse_port`: the port is shared with the service's other workers (runtime/workers.py).
    `front_door`: the port clients call (the gateway's), whose windows stay fixed."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Let clients keep idle connections alive with pings without being sent GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
        # grpc turns SO_REUSEPORT on by default: a second server on a taken port would then
        # start fine and silently receive part of the first one's connections. Fail instead,
        # unless this is one of several workers, whose supervisor checked the port was free.
        ("grpc.so_reuseport", int(reuse_port)),
    ]
    if front_door:
        options += FRONT_DOOR_LIMITS
        # gRPC grows a stream's receive window with the measured bandwidth-delay product, to
        # megabytes on loopback: a PredictStream whose client wrote and never read had 4.2 MB
        # of requests buffered in the gateway past the 64 it works on (100 such streams, 425
        # MB; a probe). With the probe off a stream's window stays 64 KiB, and a client that
        # writes ahead of what the gateway reads is held back there. The gateway's requests
        # are texts, far below a window; the hops behind it, which carry tensors, keep it.
        options.append(("grpc.http2.bdp_probe", 0))
    if max_connection_age_s > 0:
        # A gRPC client resolves a dns:/// name again only when a connection ends, so without
        # this a replica added after the callers connected (a scale-out, a rollout's surge)
        # would get no calls from them. gRPC adds +-10% jitter to the age, so replicas'
        # callers do not reconnect all at once. No grace: a stream (a gateway's invalidation
        # watch, a PredictStream) keeps its old connection until it ends; the age only moves
        # new calls to a new connection.
        options.append(("grpc.max_connection_age_ms", int(max_connection_age_s * 1e3)))
    return options


def role_of(service: object) -> str:
    """The service table's name for `service` (what `{name}` in a TLS path becomes)."""
    module = type(service).__module__
    return next((str(s.name) for s in SERVICES if s.module == module), "service")


def _runs(service: object) -> set[ServiceName]:
    """The services this process runs: its own and those co-located in it (the gateway's)."""
    role = role_of(service)
    own = {ServiceName(role)} if role in set(ServiceName) else set()
    co_located: set[ServiceName] = getattr(service, "co_located", set)()
    return own | co_located


def _check_peers_have_tls(config: ServerConfig, tls: TlsFiles) -> None:
    """Peers named (other than the default) on a port without a certificate: the operator
    asked for client certificates and the port would serve plaintext to anyone."""
    field = next(f for f in dataclasses.fields(config) if f.name == "tls_peers")
    if tls.cert or config.tls_peers == field.default:
        return
    setting = setting_of(config, "tls_peers")
    raise TlsConfigError(
        f"{setting}={config.tls_peers!r} asks callers for a client certificate, but "
        f"{CERT_ENV} is not set, so the port would serve plaintext to anyone: set {CERT_ENV} "
        f"and {KEY_ENV}, or unset {setting}"
    )


def _bind(server: grpc.aio.Server, config: ServerConfig, tls: TlsFiles) -> int | None:
    """Bind the port, over TLS when the config has a certificate; None when it cannot."""
    problem = port_problem(config.listen, listen=True)
    if problem is not None:
        log.error(
            "cannot bind",
            extra={
                "listen": config.listen,
                "setting": setting_of(config, "listen"),
                "error": problem,
            },
        )
        return None
    try:
        _check_peers_have_tls(config, tls)
        credentials = server_credentials(tls, config.tls_peers)
    except TlsConfigError as exc:  # a certificate or key missing, unreadable or mismatched
        log.error("cannot serve TLS", extra={"listen": config.listen, "error": str(exc)})
        return None
    try:
        if credentials is None:
            return server.add_insecure_port(config.listen)
        return server.add_secure_port(config.listen, credentials)
    except RuntimeError as exc:
        log.error(
            "cannot bind",
            extra={
                "listen": config.listen,
                "setting": setting_of(config, "listen"),
                "error": str(exc),
            },
        )
        return None


async def _listen(
    server: grpc.aio.Server, config: ServerConfig, tls: TlsFiles, peers: PeerCheck | None
) -> bool:
    """Bind and start accepting; False when the port cannot be bound."""
    port = _bind(server, config, tls)
    if port is None:
        return False
    await server.start()
    log.info(
        "listening",
        extra={
            "listen": config.listen,
            "port": port,
            "tls": bool(tls.cert),
            "peers": sorted(peers.allowed) if peers else [],
            "worker": worker_index(),
            "event_loop": event_loop.running(),
            "grpc_io": grpc_io.in_effect(),
            "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        },
    )
    return True


def _port_to_ourselves(listen: str) -> bool:
    """False, said, when a process other than this worker's siblings listens where the
    worker just bound: with SO_REUSEPORT it would be handed some of the gateway's connections."""
    others = strangers(listen)
    if others:
        log.error(
            "address in use",
            extra={
                "listen": listen,
                "error": f"address in use: {listen}: {'; '.join(others)} listens there too "
                "(SO_REUSEPORT), so the workers would share its connections; stop it, or give "
                "the service another port",
            },
        )
    return not others


async def _serve_probes(config: ServerConfig, health: HealthServicer) -> bool:
    """grpc.health.v1 alone, in plaintext, on `HOPLINE_HEALTH_PORT` of the listen address's
    host (loopback for a Unix socket), when set: Kubernetes' gRPC probes cannot speak TLS,
    and a service with a certificate serves only TLS on its own port. It answers from the
    service's own health servicer, so it says NOT_SERVING, SERVING and draining as that does,
    and nothing but health is reachable on it. Kept for the life of the process."""
    if config.health_port <= 0:
        return True
    host = "127.0.0.1" if config.listen.startswith("unix:") else config.listen.rpartition(":")[0]
    address = f"{host}:{config.health_port}"
    probes = grpc.aio.server(
        options=server_options(config.max_message_bytes, reuse_port=worker_index() is not None)
    )
    health_pb2_grpc.add_HealthServicer_to_server(
        # Its own bound: a flood of watches here (anyone reaches this port) leaves the
        # service's own port's watchers be.
        health,
        cast(
            grpc.aio.Server,
            WrappingRegistrar(probes, (), infra=(StreamCap(MAX_INFRA_STREAMS),)),
        ),
    )
    try:
        probes.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("cannot bind the health port", extra={"listen": address, "error": str(exc)})
        return False
    await probes.start()
    _PROBE_SERVERS.append(probes)  # referenced: a server that is collected stops serving
    log.info("health port", extra={"listen": address})
    return True


_PROBE_SERVERS: list[grpc.aio.Server] = []


async def _stop_servers(server: grpc.aio.Server) -> None:
    """A failed start's servers, the health port's too, stopped while the loop runs: one left
    to the collector after the loop had closed printed "Exception ignored in: Server.__del__
    ... RuntimeError: Event loop is closed", 8 lines that are not JSON, at every failed start
    of a pod with a health port (a deploy probe)."""
    await asyncio.gather(*(s.stop(0) for s in (server, *_PROBE_SERVERS)))
    _PROBE_SERVERS.clear()


async def serve(service: Service, config: ServerConfig) -> int:
    """Run `service` until SIGTERM/SIGINT/SIGHUP, then drain and end the process (exit code 0).

    Returns an exit code only when the service could not start."""
    if 0 < config.max_connection_age_s < 1:
        # gRPC takes whole milliseconds, and under 1 s every connection was sent GOAWAY before
        # its calls could finish (health checks DEADLINE_EXCEEDED; a settings probe).
        raise SettingError(
            f"HOPLINE_MAX_CONNECTION_AGE_S={config.max_connection_age_s:g}: 0 (never) or at "
            "least 1 s"
        )
    raise_soft_limit()  # before milvus-lite or any worker starts: they inherit it
    gate = ReadinessGate()
    tls = TlsFiles.of(config, role_of(service))
    server = grpc.aio.server(
        options=server_options(
            config.max_message_bytes,
            config.max_connection_age_s,
            reuse_port=worker_index() is not None,
            front_door=role_of(service) == ServiceName.GATEWAY,
        )
    )
    health = HealthServicer()
    # The peer check comes first: a caller the service does not serve learns nothing more,
    # reflection and the KServe probes included.
    peers = peer_check(tls, config.tls_peers, setting_of(config, "tls_peers"))
    # Health answers any caller (decoded as every method is, so bytes that do not parse are
    # INVALID_ARGUMENT, not UNKNOWN with a traceback in the log). Its watches on this port are
    # not bounded: every gateway's channel keeps one (gRPC's client-side health checking),
    # and a refused one takes the service for down, so any bound was a way to take it down
    # (reviewer's and operator's probes: 64 watches held from the gateway's own address, a
    # plaintext mesh's loopback, and a new gateway answered every miss UNAVAILABLE).
    # Reflection's streams are bounded per client, the port's peers not counted.
    streams = StreamCap(MAX_INFRA_STREAMS, exempt=peers.permits if peers else None)
    health_pb2_grpc.add_HealthServicer_to_server(
        health, cast(grpc.aio.Server, WrappingRegistrar(server, ()))
    )
    # Each method's handler is wrapped once here, not per call (see hopline.runtime.interceptors).
    wrappers: list[RpcWrapper] = [gate, ServerTracing(config.test_delay_ms)]
    if config.test_fault:
        wrappers.append(FaultInjection(config.test_fault))
    wrappers.extend(getattr(service, "rpc_wrappers", list)())
    registrar = cast(
        grpc.aio.Server,
        WrappingRegistrar(
            server,
            [peers, *wrappers] if peers else wrappers,
            infra=(peers, streams) if peers else (streams,),
        ),
    )
    service.register(registrar)
    if config.reflection:
        reflection.enable_server_reflection(
            [
                *service.service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            registrar,
        )
    for name in ("", *service.service_names):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    # A worker binds only once it is ready: the kernel hands connections only to bound
    # listeners, so none lands on a worker still loading. A lone process binds first, so
    # probes can see NOT_SERVING while it starts.
    index = worker_index()
    late_bind = index is not None
    if not late_bind and not await _listen(server, config, tls, peers):
        return 2
    if not late_bind and not await _serve_probes(config, health):
        await server.stop(0)
        return 2
    if index is None:
        start_metrics_server(config.metrics_host, config.metrics_port, ProcessView(_runs(service)))
    else:  # the supervisor serves the service's port, every worker's metrics merged
        serve_own_metrics(index, ProcessView(_runs(service)))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)

    starting = asyncio.ensure_future(service.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        failure = starting.exception()
        if failure is not None:
            log.error("start-up failed", extra={"error": f"{type(failure).__name__}: {failure}"})
            await _stop_servers(server)
            # A setting that cannot work is the operator's typo (2, as cli/main.py says at
            # load); anything else (Milvus down, a model that fails) is an outage (1).
            return 2 if isinstance(failure, SettingError) else 1
        if late_bind and not (
            await _listen(server, config, tls, peers)
            and _port_to_ourselves(config.listen)
            and await _serve_probes(config, health)
        ):
            await service.stop()
            await _stop_servers(server)
            return 2
        collector.settle()  # before the first request, so none waits for its full collection
        gate.ready = True
        for name in ("", *service.service_names):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"services": list(service.service_names)})
        watch = asyncio.ensure_future(FdWatch().run())  # referenced until the process ends
        await stopping
        watch.cancel()
    else:
        starting.cancel()

    await _drain(server, service, config, health, gate)
    await service.stop()
    shutdown_tracing()
    log.info("stopped")
    _end_process(0)


async def _drain(
    server: grpc.aio.Server,
    service: Service,
    config: ServerConfig,
    health: HealthServicer,
    gate: ReadinessGate,
) -> None:
    """Report NOT_SERVING first (balancers and probes move away) and keep answering for the
    delay; then refuse new RPCs with UNAVAILABLE and give in-flight ones the grace period to
    finish. The server is stopped (which cancels what still runs) only when the grace ran out."""
    log.info("draining", extra={"delay_s": config.drain_delay_s, "grace_s": config.drain_grace_s})
    await health.enter_graceful_shutdown()
    begin_drain = getattr(service, "begin_drain", None)  # optional: readiness in its own API
    if begin_drain is not None:
        begin_drain()
    await asyncio.sleep(config.drain_delay_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.drain_grace_s
    gate.draining = True
    drain = getattr(service, "drain", None)  # optional: end streams held open indefinitely
    if drain is not None:
        await drain()
    if await gate.settle(deadline - loop.time()):
        # The replies of the last calls to finish are written by grpc after their handlers
        # return; give them a moment to reach the socket before the process ends.
        await asyncio.sleep(REPLY_FLUSH_S)
    else:
        log.warning("grace period over: cancelling the RPCs still in flight")
        await gate.cut()
        await server.stop(0)


def _end_process(code: int) -> NoReturn:
    """End the process without grpc's server shutdown.

    grpc's shutdown fails the calls that have reached the process but that no handler has
    taken yet with CANCELLED (grpc/grpc#41785), and callers rightly do not retry CANCELLED.
    Callers that ignore health keep sending until their connection ends, so some of their
    calls are always in that state at the moment of a shutdown. Ending the process closes the
    connections instead: those calls fail with UNAVAILABLE, which callers retry elsewhere.
    (asyncio.run's teardown would run grpc's shutdown, hence os._exit; services release what
    outlives the process in their stop(), e.g. the milvus-lite server the cache started.)
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
