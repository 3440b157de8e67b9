"""The one launcher of a mesh of processes: `hopline run`, the tests and the bench suite use it.

Each service is `python -m hopline serve NAME` in its own process group, told where every
service listens through the HOPLINE_<NAME>_ADDR variables the service table names. With
`die_with_parent`, children get SIGTERM when the launcher dies without a chance to clean up,
so a killed `hopline run` never leaves orphans holding the ports (each child asks for it
after exec: runtime/parent.py says why not before).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.api_keys import operator_metadata
from hopline.runtime.parent import LAUNCHER_ENV
from hopline.runtime.ports import address_in_use, free_ports
from hopline.runtime.service_table import INPROC, SERVICES, ServiceName, spec
from hopline.runtime.tls import ClientTls, channel, operator_tls

log = logging.getLogger("hopline.launcher")

ALL: tuple[ServiceName, ...] = tuple(s.name for s in SERVICES)
SERVING = int(health_pb2.HealthCheckResponse.SERVING)
STOP_TIMEOUT_S = 15.0
CALLEES_STOP_S = 2.0  # of a stop's budget, kept for the services the gateway calls


def health_status(target: str, timeout_s: float = 1.0, tls: ClientTls | None = None) -> int | None:
    """The grpc.health.v1 status of the server at `target`, or None if it does not answer."""
    try:
        with channel(target, tls) as chan:
            reply = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
    except grpc.RpcError:
        return None
    return int(reply.status)


def is_serving(target: str, timeout_s: float = 1.0, tls: ClientTls | None = None) -> bool:
    return health_status(target, timeout_s, tls) == SERVING


def rpcs_answered(metrics_port: int, method: str = "", code: str = "", worker: str = "") -> float:
    """RPCs a service process has answered (of `method`, with status `code`, by worker
    `worker` of several (runtime/workers.py), where given), from its /metrics on loopback."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hopline_rpc_duration_seconds_count{")
        and (not method or f'method="{method}"' in line)
        and (not code or f'code="{code}"' in line)
        and (not worker or f'worker="{worker}"' in line)
    )


def spread_ports(env: Mapping[str, str], variable: str) -> dict[str, int]:
    """`variable`=P (HOPLINE_METRICS_PORT, HOPLINE_HEALTH_PORT) for the whole mesh: P for the
    gateway, the next ports for the rest in the table's order. One variable reached every
    process, so the first to bind took P and the others logged that they could not (a
    scrape of P got whichever won; a health port failed every start but the first)."""
    raw = env.get(variable, "").strip()
    if not raw.isdigit() or int(raw) == 0:  # 0 (off) holds for all; a bad value is refused
        return {}  # by each service, naming it
    base = int(raw)
    # In the order of their own default ports (gateway 8002, then 8021-8024), as the README's
    # settings table says, not in the order they start.
    order = sorted(ALL, key=lambda name: spec(name).metrics_port)
    return {str(name): base + i for i, name in enumerate(order)}


METRICS_PORT, HEALTH_PORT = "HOPLINE_METRICS_PORT", "HOPLINE_HEALTH_PORT"

# What the launcher's own calls to the gateway cannot outwait, and what sets it.
REFUSED = {
    grpc.StatusCode.PERMISSION_DENIED: "the launcher calls as `operator`: with "
    "HOPLINE_GATEWAY_TLS_PEERS set, name operator in it",
    grpc.StatusCode.UNAUTHENTICATED: "the launcher sends the first key of HOPLINE_API_KEYS",
}


class MeshError(RuntimeError):
    """A service exited or did not become ready in time; the message carries logs' tails."""


class StartInterrupted(Exception):
    """Start-up was called off (Ctrl-C) before the mesh was ready."""


CHECK_BOUND_S = 3.0  # `Mesh.bound_checks`: the most one check may take (they ask for 1 s)


class _Overdue(Exception):
    """A check outlived CHECK_BOUND_S (raised by SIGALRM's handler)."""


def _raise_overdue(signum: int, frame: FrameType | None) -> None:
    raise _Overdue


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raises _Overdue in the main thread once `seconds` have passed inside the block; an
    alarm set before it (pytest-timeout's) is set again after, for what was left of it."""
    previous = signal.signal(signal.SIGALRM, _raise_overdue)
    started = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            left = outer - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), interval)


class Mesh:
    """hopline services as child processes, each on the address the table (or `addrs`) gives.

    `env` goes to every service, `service_env[NAME]` to one. With `log_dir`, each service
    writes `<log_dir>/<name>.log`; without it, children share this process's stdout.
    """

    def __init__(
        self,
        model_repo: Path,
        *,
        addrs: Mapping[str, str] | None = None,
        metrics_ports: Mapping[str, int] | None = None,
        env: Mapping[str, str] | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        log_dir: Path | None = None,
        die_with_parent: bool = False,
        bound_checks: bool = False,
    ) -> None:
        self.repo = model_repo
        self.log_dir = log_dir
        self.die_with_parent = die_with_parent
        self.bound_checks = bound_checks
        self._overdue_said = False
        self.service_env = {name: dict(values) for name, values in (service_env or {}).items()}
        self.env = {**os.environ, **(env or {}), "HOPLINE_MODEL_REPO": str(model_repo.resolve())}
        self.addrs = {s.name: s.address(self.env) for s in SERVICES} | dict(addrs or {})
        self.metrics_ports = dict(metrics_ports or {}) or spread_ports(self.env, METRICS_PORT)
        self.health_ports = spread_ports(self.env, HEALTH_PORT)
        for name, addr in self.addrs.items():
            self.env[spec(name).addr_env] = addr
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_timeout_s = STOP_TIMEOUT_S  # `stop`'s, also when a start is given up

    @classmethod
    def on_free_ports(
        cls,
        model_repo: Path,
        workdir: Path,
        *,
        addrs: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> Mesh:
        """A mesh beside any other: free loopback ports for gRPC and /metrics, its own
        milvus-lite file (one process per database file) and its logs in `workdir`."""
        ports = iter(free_ports(2 * len(ALL)))
        return cls(
            model_repo,
            addrs={name: f"127.0.0.1:{next(ports)}" for name in ALL} | dict(addrs or {}),
            metrics_ports={name: next(ports) for name in ALL},
            env={"HOPLINE_CACHE_URI": str(workdir / "cache.db"), **(env or {})},
            service_env=service_env,
            log_dir=workdir,
        )

    @property
    def gateway(self) -> str:
        return self.addrs[ServiceName.GATEWAY]

    def service_env_value(self, service: str, name: str) -> str | None:
        """What `name` is in `service`'s environment."""
        return self.service_env.get(service, {}).get(name, self.env.get(name))

    def log(self, name: str) -> str:
        """The service's log so far ('' when it shares our stdout)."""
        if self.log_dir is None:
            return ""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def colocated(self, name: str) -> bool:
        """Whether `name` runs inside the gateway (address `inproc`): no process of its own."""
        return name != ServiceName.GATEWAY and self.addrs[name] == INPROC

    def spawn(self, names: Iterable[str] = ALL) -> None:
        """Start the processes without waiting for them to serve (none for co-located ones)."""
        for name in names:
            if self.colocated(name):
                continue
            env = dict(self.env)
            if name in self.metrics_ports:
                env[METRICS_PORT] = str(self.metrics_ports[name])
            if name in self.health_ports:
                env[HEALTH_PORT] = str(self.health_ports[name])
            env |= self.service_env.get(name, {})
            if self.die_with_parent:
                env[LAUNCHER_ENV] = str(os.getpid())  # the child follows it (`follow_parent`)
            out: IO[bytes] | None = None
            if self.log_dir is not None:
                out = (self.log_dir / f"{name}.log").open("ab")
            try:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "hopline", "serve", name],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    process_group=0,  # a Ctrl-C reaches the launcher, which stops them in order
                )
            finally:
                if out is not None:
                    out.close()  # the child holds its own descriptor

    def metrics_endpoints(self) -> list[str]:
        """`HOST:PORT` of each started process's Prometheus endpoint (a co-located service's
        metrics are in the gateway's), as `hopline bench --metrics` takes them."""
        host = self.env.get("HOPLINE_METRICS_HOST", "127.0.0.1")
        return [f"{host}:{self.metrics_ports[n]}" for n in self.procs if n in self.metrics_ports]

    def exited(self) -> dict[str, int]:
        """Exit codes of the services that are no longer running."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def wait_until(
        self,
        what: str,
        ready: Callable[[], bool],
        deadline: float,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        """Poll `ready` until it holds; MeshError when a service exits or the deadline passes,
        StartInterrupted when `stopping` says so (a Ctrl-C during start-up)."""
        while not self._check(ready):
            if stopping():
                raise StartInterrupted(what)
            if dead := self.exited():
                name = next(iter(dead))
                raise MeshError(
                    f"{name} exited {dead[name]} while waiting for {what}:\n"
                    f"{self.log(name)[-4000:]}"
                )
            if time.monotonic() > deadline:
                logs = "".join(f"\n--- {n}:\n{self.log(n)[-2000:]}" for n in self.procs)
                raise MeshError(f"not ready in time: {what}{logs}")
            time.sleep(0.1)

    def client_tls(self, name: str) -> ClientTls | None:
        """How the launcher dials `name`: with the operator's certificate when TLS is on."""
        return operator_tls(name, self.env)

    def _answering(self, name: str) -> Callable[[], bool]:
        """Whether `name` answers its health check at all (NOT_SERVING while it starts)."""
        return lambda: health_status(self.addrs[name], tls=self.client_tls(name)) is not None

    def _serving(self, name: str) -> Callable[[], bool]:
        return lambda: health_status(self.addrs[name], tls=self.client_tls(name)) == SERVING

    def serving(self, name: str) -> bool:
        """Whether `name` answers its health check SERVING now."""
        return self._check(self._serving(name))

    def _check(self, check: Callable[[], bool]) -> bool:
        """`check()`; with `bound_checks`, False once it has taken CHECK_BOUND_S.

        gRPC's deadline bounds a check only while gRPC core can run its timers: under a pids
        limit reached mid-run it could not start their thread, a health check's 1 s deadline
        never fired, and `hopline run` waited in it for good, its restarts stopped and Ctrl-C
        unheard (its handler only sets a flag the loop reads; a resource-exhaustion probe, 2
        of 2). SIGALRM's handler raises out of gRPC's wait, which runs Python's signal handlers
        every 0.2 s. Main thread only: so only `hopline run`, single-threaded, turns it on."""
        if not self.bound_checks:
            return check()
        try:
            with _alarm(CHECK_BOUND_S):
                answer = check()
        except _Overdue:
            if not self._overdue_said:
                self._overdue_said = True
                log.warning(
                    "a health check outlived its deadline: the host may be out of threads "
                    "(a pids or process limit); checks go on, each given up after its bound",
                    extra={"bound_s": CHECK_BOUND_S},
                )
            return False
        self._overdue_said = False
        return answer

    def wait_serving(self, name: str, timeout_s: float = 120.0) -> None:
        self.wait_until(f"{name} SERVING", self._serving(name), time.monotonic() + timeout_s)

    def local_tier_live(self) -> bool:
        """Whether the gateway's local exact tier serves (its watch on the cache connected)."""
        try:
            with channel(self.gateway, self.client_tls(ServiceName.GATEWAY)) as chan:
                stats = gateway_pb2_grpc.GatewayServiceStub(chan).GetStats(
                    gateway_pb2.GetStatsRequest(),
                    timeout=1.0,
                    metadata=operator_metadata(self.env),  # GetStats needs a key when set
                )
        except grpc.RpcError as err:
            code = err.code()
            if code in REFUSED:  # asking again will not change it: say why now
                raise MeshError(
                    "the gateway refused the launcher's GetStats, which says whether its local "
                    f"exact tier is live: {code.name}: {err.details()} "
                    f"({REFUSED[code]})"
                ) from None
            return False
        return stats.counters.get("local_exact_live") == 1

    def start(
        self,
        names: Iterable[str] = ALL,
        timeout_s: float = 120.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> Self:
        """Start `names` and return when each answers, in the order that makes "ready" true.

        The gateway's upstreams first. The gateway starts once each of them listens (a
        service binds before it loads, and answers NOT_SERVING until ready), not once it
        serves: a gateway channel that met a refused connection backs off and fails the first
        requests sent on it (FAIL_OPEN on the cache, UNAVAILABLE on inference), while one that
        meets a service still starting only waits (the gateway asks inference for its models
        until it answers). So the gateway's start overlaps theirs: `make run` co-located, a
        new cache file, up in 3.2-3.4 s one after the other and 1.9-2.3 s so (3 alternated
        runs; five processes on 2 cores, 2.4-3.2 against 2.6-2.7, level). "Ready" then waits
        for every upstream SERVING, the gateway SERVING and, with the cache running and the
        local exact tier on, that tier live, so the first repeat is an EXACT hit. On any
        failure every service started is stopped.
        """
        names = tuple(names)
        taken = [
            f"{name} on {self.addrs[name]} ({spec(name).addr_env})"
            for name in names
            if not self.colocated(name) and address_in_use(self.addrs[name])
        ]
        if taken:
            raise MeshError(
                f"address in use: {', '.join(taken)}. Another `hopline run` (or another "
                "program) listens there: stop it, or give these services other addresses"
            )
        deadline = time.monotonic() + timeout_s
        upstreams = [n for n in names if n != ServiceName.GATEWAY and not self.colocated(n)]
        local_tier = self.service_env_value("gateway", "HOPLINE_GATEWAY_EXACT_ENTRIES") != "0"
        try:
            self.spawn(upstreams)
            if ServiceName.GATEWAY in names:
                for name in upstreams:
                    self.wait_until(f"{name} listening", self._answering(name), deadline, stopping)
                self.spawn([ServiceName.GATEWAY])
            for name in upstreams:
                self.wait_until(f"{name} SERVING", self._serving(name), deadline, stopping)
            if ServiceName.GATEWAY in names:
                self.wait_until(
                    "gateway SERVING",
                    lambda: is_serving(self.gateway, tls=self.client_tls(ServiceName.GATEWAY)),
                    deadline,
                    stopping,
                )
                if ServiceName.CACHE in names and local_tier:
                    self.wait_until(
                        "the gateway's local exact tier", self.local_tier_live, deadline, stopping
                    )
        except BaseException:
            self.stop(self.stop_timeout_s)
            raise
        return self

    def terminate(self, name: str, timeout_s: float = STOP_TIMEOUT_S) -> int:
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout_s)

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Start's order reversed: the gateway first, then the services it calls, each sent
        SIGTERM (it drains) and SIGKILL if still running at the deadline. The gateway's drain
        sends the stores it still holds (HOPLINE_GATEWAY_STORE_LINGER_MS) to a cache that
        still serves them; stopped together, the cache went NOT_SERVING first and a miss
        answered just before the stop was never cached. The gateway's deadline leaves the
        others CALLEES_STOP_S of the budget: a gateway that used it all left the cache none,
        and its held stores were lost with a cache killed undrained."""
        deadline = time.monotonic() + timeout_s
        callers = [n for n in self.procs if n == ServiceName.GATEWAY]
        self._stop(callers, deadline - min(CALLEES_STOP_S, timeout_s / 2))
        self._stop([n for n in self.procs if n not in callers], deadline)

    def _stop(self, names: list[str], deadline: float) -> None:
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in names:
            proc = self.procs[name]
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("did not drain in time; killing", extra={"service": name})
                proc.kill()
                proc.wait()
