"""`hopline run` (what `make run` calls): the whole mesh on this machine, until Ctrl-C.

"hopline is up" means every service answers and the first repeat is an EXACT hit: the
launcher starts the upstreams that run as processes until SERVING, then the gateway (which is
SERVING only once the services it runs in-process are), then waits for its local exact tier
to be live (runtime/launcher.py:Mesh.start says why in that order). The line says how long
start-up took and which services run inside the gateway (`--topology`).

Then it supervises, as Kubernetes or compose would: a service that exits is started again
after a backoff that doubles from RESTART_BACKOFF_S (the gateway fails open without the cache
meanwhile, and every caller's channel reconnects), and logged when SERVING again; one that
exits MAX_RESTARTS times within RESTART_WINDOW_S stops the mesh, as any exit did before, but
for the cache, which the mesh serves without (SERVED_WITHOUT): it is started again every
RETRY_WITHOUT_S, said each time.
"""

from __future__ import annotations

import logging
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from hopline.runtime.launcher import (
    ALL,
    HEALTH_PORT,
    METRICS_PORT,
    Mesh,
    MeshError,
    StartInterrupted,
)
from hopline.runtime.parent import STOP_SIGNALS
from hopline.runtime.ports import port_problem
from hopline.runtime.service_table import ServiceName, Topology, spec

log = logging.getLogger("hopline.run")

# Ctrl-C stops every service within this (README: "within 10 s"), before "up" as after.
STOP_TIMEOUT_S = 10.0


# README.md "Placement" has the measurements behind this default.
DEFAULT_TOPOLOGY = Topology.COLOCATED

# "Up" within this beyond the cache's bound on loading its collection (`ready_bound_s`).
READY_TIMEOUT_S = 180.0

RESTART_BACKOFF_S = 0.5  # before the first restart; doubled for each within the window
MAX_RESTART_BACKOFF_S = 8.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 120.0
POLL_S = 0.3  # how often the supervisor looks at its services
NOT_BACK_WARN_S = 60.0  # a restarted service not SERVING after this long is said to be late
# Services whose process the mesh answers without: the gateway fails open past the cache. One
# that kept exiting (a damaged file) stopped the whole mesh, which was answering every
# request meanwhile (a cache probe: 35 s of FAIL_OPEN answers, then every request UNAVAILABLE).
SERVED_WITHOUT = frozenset({ServiceName.CACHE})
RETRY_WITHOUT_S = 30.0


class Restarts:
    """When each service that exited may start again (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._times: dict[str, list[float]] = {}

    def delay(self, name: str) -> float | None:
        """Seconds to wait before starting `name` again; None when it exits too often."""
        now = self._clock()
        recent = [t for t in self._times.get(name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS:
            return None
        self._times[name] = [*recent, now]
        return min(RESTART_BACKOFF_S * float(2 ** len(recent)), MAX_RESTART_BACKOFF_S)


def supervise(
    mesh: Mesh,
    stopping: Callable[[], bool],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Keep the mesh's processes running until `stopping()`; 0, or 1 when one keeps exiting."""
    restarts = Restarts(clock)
    due: dict[str, float] = {}  # exited: when to start it again
    back: dict[str, float] = {}  # started again, not SERVING yet: since when
    late: set[str] = set()  # of those, the ones said to be late
    while not stopping():
        now = clock()
        for name, code in mesh.exited().items():
            if name in due:
                continue
            delay = restarts.delay(name)
            if delay is None and name in SERVED_WITHOUT:
                log.error(
                    "service keeps exiting; the mesh serves on without it (the gateway answers "
                    "from the model, FAIL_OPEN) and starts it again in_s from now; its own "
                    "lines above say why it exits",
                    extra={"service": name, "exit_code": code, "in_s": RETRY_WITHOUT_S},
                )
                due[name] = now + RETRY_WITHOUT_S
                continue
            if delay is None:
                log.error(
                    "service keeps exiting; stopping the mesh",
                    extra={"service": name, "exit_code": code, "exits": MAX_RESTARTS + 1,
                           "window_s": RESTART_WINDOW_S},
                )  # fmt: skip
                return 1
            log.warning(
                "service exited; starting it again",
                extra={"service": name, "exit_code": code, "in_s": delay},
            )
            due[name] = now + delay
        for name, when in list(due.items()):
            if now >= when:
                del due[name]
                mesh.spawn([name])
                back[name] = now
        for name, since in list(back.items()):
            if name in due or mesh.procs[name].poll() is not None:
                continue
            if mesh.serving(name):
                del back[name]
                late.discard(name)
                log.info(
                    "service SERVING again",
                    extra={"service": name, "after_s": round(clock() - since, 1)},
                )
            elif now - since > NOT_BACK_WARN_S and name not in late:
                late.add(name)  # once a restart: it may yet come back, and says so then
                log.warning(
                    "service started again but not SERVING yet; its own lines above say why",
                    extra={"service": name, "after_s": round(now - since, 1)},
                )
        sleep(POLL_S)
    return 0


def ready_bound_s() -> float:
    """How long `hopline run` waits for "up": READY_TIMEOUT_S beyond the cache's own bound on
    loading its collection (HOPLINE_CACHE_LOAD_TIMEOUT_S, read as the cache will read it),
    which grows with the rows (1,000,000 entries: "up" in 88 s on 2 cores), so a full cache is
    not given up on while it loads within the bound it was given."""
    from hopline.cache.config import CacheConfig
    from hopline.runtime.config import load

    return READY_TIMEOUT_S + load(CacheConfig, []).load_timeout_s


def run_mesh(
    model_repo: Path,
    log_format: str = "text",
    ready_timeout_s: float | None = None,
    topology: Topology = DEFAULT_TOPOLOGY,
) -> int:
    from hopline.observability.logs import LogFormat, setup_logging

    started = time.monotonic()
    if ready_timeout_s is None:
        ready_timeout_s = ready_bound_s()
    setup_logging("run", fmt=LogFormat(log_format))
    if not model_repo.is_dir():
        log.error(
            "no model repository: `make model` builds the bundled one in models/, `hopline "
            "model build --default --repo PATH` anywhere else",
            extra={"path": str(model_repo)},
        )
        return 2
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    # Children share our stdout: their logs are the mesh's log.
    mesh = Mesh(
        model_repo,
        addrs=topology.addrs(),
        env={"HOPLINE_LOG_FORMAT": log_format},
        die_with_parent=True,
        bound_checks=True,
    )
    mesh.stop_timeout_s = STOP_TIMEOUT_S
    # Before any probe of the addresses: 127.0.0.1:99999 was an OverflowError traceback.
    wrong = [
        f"{spec(name).addr_env}={problem}"
        for name in ALL
        if not mesh.colocated(name)
        and (problem := port_problem(mesh.addrs[name], listen=True)) is not None
    ]
    wrong += spread_port_problems(mesh)
    if wrong:
        log.error("cannot start", extra={"error": "; ".join(wrong)})
        return 2
    if taken := taken_side_ports(mesh):
        log.error("cannot start", extra={"error": "; ".join(taken)})
        return 1
    try:
        mesh.start(ALL, ready_timeout_s, stopping=lambda: stopping)
    except StartInterrupted:
        return 0  # start() has stopped what it started
    except MeshError as exc:
        # Its first line: the services write their logs to this terminal, above it.
        said = str(exc).splitlines()[0].rstrip(":")
        log.error(
            "the mesh did not start (the service's own lines are above)", extra={"error": said}
        )
        return 1
    took = time.monotonic() - started
    log.info("mesh ready", extra={"start_up_s": round(took, 1)})
    upstreams = ", ".join(
        f"{name} (in the gateway)" if mesh.colocated(name) else name
        for name in ALL
        if name != "gateway"
    )
    # The gateway's flag where it is not where `hopline predict` dials by default, so the
    # line reaches this mesh from a shell without this one's HOPLINE_GATEWAY_ADDR.
    flag = "" if mesh.gateway == spec("gateway").default_addr else f" --gateway {mesh.gateway}"
    sys.stdout.write(
        f"\nhopline is up in {took:.1f} s: gateway SERVING on {mesh.gateway}, "
        f"{upstreams} SERVING ({topology} topology)\n"
        f'  try: {_command()} predict{flag} "I forgot my password"\n'
        + (f"  metrics: {metrics}\n" if (metrics := _metrics_line(mesh)) else "")
        + "  stop: Ctrl-C\n\n"
    )
    sys.stdout.flush()
    try:
        return supervise(mesh, lambda: stopping)
    finally:
        log.info("stopping the mesh")
        mesh.stop(STOP_TIMEOUT_S)


def _metrics_line(mesh: Mesh) -> str:
    """Where each process serves /metrics, when HOPLINE_METRICS_PORT moved them (a co-located
    service's are in the gateway's)."""
    if not mesh.metrics_ports:
        return ""
    host = mesh.env.get("HOPLINE_METRICS_HOST", "127.0.0.1")
    return ", ".join(
        f"{name} {host}:{port}"
        for name, port in mesh.metrics_ports.items()
        if not mesh.colocated(name)
    )


def _command() -> str:
    """How this `hopline` was run, for the "try:" line: `.venv/bin/hopline` under `make
    run`, whatever path it was given otherwise (the line named `.venv/bin/hopline` even where
    no .venv was beside the shell)."""
    invoked = Path(sys.argv[0])
    if invoked.name == "hopline":
        return shlex.quote(str(invoked))
    return f"{shlex.quote(sys.executable)} -m hopline"


def _side_ports(mesh: Mesh) -> Iterator[tuple[str, dict[str, int]]]:
    """Each side-port variable with the ports `hopline run` gives its own processes (a
    co-located service has none of its own)."""
    for variable, ports in ((METRICS_PORT, mesh.metrics_ports), (HEALTH_PORT, mesh.health_ports)):
        yield variable, {n: p for n, p in ports.items() if not mesh.colocated(n)}


def taken_side_ports(mesh: Mesh) -> list[str]:
    """The /metrics and health ports `hopline run` would give its services that something
    else holds now. A service goes on without its /metrics when its port is taken (it logs
    that), so a second mesh on the same HOPLINE_METRICS_PORT said "up" and named the first
    mesh's /metrics as its own (an operator's probe)."""
    host = mesh.env.get("HOPLINE_METRICS_HOST", "127.0.0.1")
    taken = []
    for variable, ports in _side_ports(mesh):
        for name, port in ports.items():
            if not 0 < port <= 65535:
                continue
            with socket.socket() as probe:
                # As the servers bind: a port a mesh stopped a moment ago (TIME_WAIT) is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((host if variable == METRICS_PORT else "", port))
                except OSError as exc:
                    taken.append(
                        f"{variable}: port {port}, {name}'s, cannot be bound ({exc.strerror}): "
                        "another mesh or program holds it; set another"
                    )
    return taken


def spread_port_problems(mesh: Mesh) -> list[str]:
    """HOPLINE_METRICS_PORT or HOPLINE_HEALTH_PORT too high for the ports `hopline run` spreads
    from it (the gateway's, then one more a service): each service refused the port it was
    given, one the user never wrote (HOPLINE_METRICS_PORT=65534 ended the start with
    "HOPLINE_METRICS_PORT=65536 ... at most 65535")."""
    problems = []
    for variable, ports in _side_ports(mesh):
        over = {n: p for n, p in ports.items() if p > 65535}
        if over:
            base = min(ports.values())
            highest = max(p - base for p in ports.values())
            problems.append(
                f"{variable}={base}: `hopline run` gives the gateway this port and each other "
                f"process the next ones in turn ({', '.join(f'{n} {p}' for n, p in over.items())}"
                f"): set at most {65535 - highest}"
            )
    return problems
