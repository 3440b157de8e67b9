"""Several processes of one service on one port (`HOPLINE_GATEWAY_WORKERS`).

A grpc.aio service is one event loop, so it keeps at most about one core busy, however many
the machine has. On a lent H100 machine (16 cores) the co-located mesh served 585 rps of CUDA
misses at c=32 while its model did 3386 rps in one process; the gateway's own hop timings
summed to 17 ms of the 50 ms p50 the client saw, and the rest was requests waiting for the
gateway's loop (bench/results/2026-11-26-h100-fused-cuda-fp16-int8-mesh.json).

`hopline serve gateway` with N > 1 workers becomes a supervisor: it starts N copies of itself,
each a full gateway with its own loop, channels and local exact tier, all bound to the same
address with SO_REUSEPORT, so the kernel spreads incoming connections over them (a connection
stays with one worker). A worker binds only once it is ready (runtime/server.py), so no
connection lands on one still starting; having bound, it checks that no process but its
siblings listens there (`strangers`), since one that took the port meanwhile with
SO_REUSEPORT would share the connections, and exits 2 naming it if one does. SIGTERM or
SIGINT to the supervisor drains every worker; a worker that exits on its own stops the rest
and the supervisor exits with its code, for the orchestrator to restart the whole gateway, as
it would a single process; a supervisor killed outright (SIGKILL) takes its workers along
(each asked for PR_SET_PDEATHSIG). Linux only (SO_REUSEPORT's balancing); on two cores there
are no spare cores for a second loop.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from hopline.runtime import listeners
from hopline.runtime.ports import address_in_use, port_problem

log = logging.getLogger("hopline.runtime.workers")

# Set in each worker's environment (its index): it serves, and binds with SO_REUSEPORT.
WORKER_ENV = "HOPLINE_WORKER_INDEX"
SUPERVISOR_ENV = "HOPLINE_WORKER_SUPERVISOR"  # the supervisor's pid
# The folder where each worker announces its own /metrics port (observability/worker_metrics.py);
# unset when the service serves no metrics.
METRICS_DIR_ENV = "HOPLINE_WORKER_METRICS_DIR"
POLL_S = 0.1


class WorkersConfigError(ValueError):
    """Settings several workers cannot serve with."""


def worker_index() -> int | None:
    """This process's index among its service's workers; None when it is no worker."""
    raw = os.environ.get(WORKER_ENV)
    return int(raw) if raw is not None and raw.isdigit() else None


def follow_supervisor() -> None:
    """A worker gets SIGTERM (and drains) when its supervisor dies, even by SIGKILL. Asked
    for here, after exec, rather than between fork and exec in the supervisor, which has
    threads by then (the gateway's imports start one)."""
    from hopline.runtime.parent import follow_parent

    follow_parent(SUPERVISOR_ENV, "the gateway's supervisor")


def check(listen: str, workers: int, setting: str, store_file: str = "") -> None:
    """WorkersConfigError when `workers` processes cannot share `listen`; `store_file`: the
    milvus-lite file of a cache co-located in each worker ("" when none is)."""
    if workers < 1:
        raise WorkersConfigError(f"{setting}={workers}: at least 1 process must serve")
    if problem := port_problem(listen, listen=True):
        raise WorkersConfigError(problem)
    if store_file:
        raise WorkersConfigError(
            f"{setting}={workers} with the cache in the gateway (HOPLINE_CACHE_ADDR=inproc) on "
            f"the milvus-lite file {store_file}: milvus-lite serves one process a file, so every "
            "worker but one would fail; run the cache as its own service, or point "
            "HOPLINE_CACHE_URI at a Milvus server"
        )
    _, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or not port.isdigit() or int(port) == 0:
        raise WorkersConfigError(
            f"{setting}={workers} needs a fixed TCP port to share, not {listen!r}: each worker "
            "binding port 0 or a Unix socket path would get an address of its own"
        )
    if address_in_use(listen):
        raise WorkersConfigError(
            f"address in use: {listen}. Another process listens there; the workers would "
            "share its connections (SO_REUSEPORT) instead of failing"
        )


def worker_env(index: int, metrics_dir: Path | None) -> dict[str, str]:
    """Worker `index`'s environment: its index, and where it announces its /metrics port
    (None: it serves none)."""
    env = {**os.environ, WORKER_ENV: str(index), SUPERVISOR_ENV: str(os.getpid())}
    env.pop(METRICS_DIR_ENV, None)
    if metrics_dir is not None:
        env[METRICS_DIR_ENV] = str(metrics_dir)
    return env


def serve_own_metrics(index: int, registry: Any = None) -> None:
    """A worker's /metrics, on the port it announces to its supervisor (if it asked for them);
    `registry`: what it shows (observability/metrics.py:ProcessView; default all)."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if directory:
        from hopline.observability.worker_metrics import serve_worker_metrics

        serve_worker_metrics(Path(directory), index, registry)


def supervise(
    name: str, argv: Sequence[str], workers: int, metrics_host: str, metrics_port: int
) -> int:
    """Run `workers` copies of `hopline serve name argv` until they all exit; their exit code
    (the first failure's, if one exited on its own). Meanwhile serve their metrics, merged,
    on the service's metrics port."""
    from hopline.observability.worker_metrics import AnnouncedPorts, serve_workers_metrics

    remove_orphaned_folders(name)
    prefix = f"{folder_prefix(name)}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        metrics_dir = Path(folder) if metrics_port else None
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "hopline", "serve", name, *argv],
                env=worker_env(i, metrics_dir),
            )
            for i in range(workers)
        ]
        log.info("workers started", extra={"service": name, "pids": [p.pid for p in procs]})
        if metrics_dir is not None:
            serve_workers_metrics(metrics_host, metrics_port, AnnouncedPorts(metrics_dir, workers))
        return _wait(procs)


def folder_prefix(name: str) -> str:
    """A supervisor's folder (its workers announce their metrics ports there) is named
    `<prefix><supervisor's pid>-<random>` in the temporary directory."""
    return f"hopline-{name}-workers-"


def remove_orphaned_folders(name: str) -> list[Path]:
    """Remove the folders of `name`'s supervisors that no longer run: one killed outright
    (SIGKILL, the OOM killer) cannot remove its own, and each such death left one behind.
    A folder whose pid runs (perhaps another process since: pids are reused) is left alone,
    as is one not named as this module names them. Returns what was removed."""
    removed: list[Path] = []
    prefix = folder_prefix(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = folder.name.removeprefix(prefix).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _running(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        pass
    return True


def _wait(procs: Sequence[subprocess.Popen[bytes]]) -> int:
    """Wait for every worker to exit, stopping them all on a signal or when one exits; their
    exit code (the first failure's, if one exited on its own)."""
    stopping = False
    failed = 0

    def stop_all() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        stop_all()

    from hopline.runtime.parent import STOP_SIGNALS

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    while True:
        # Every worker polled each pass: `any()` stopped at the first one running, so a worker
        # after it that died was never seen (the gateway served on with fewer, silently).
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            break
        exited = [(i, code) for i, code in enumerate(codes) if code is not None]
        if exited and not stopping:
            index, code = exited[0]
            log.error("worker exited; stopping the others", extra={"worker": index, "code": code})
            # A worker that ended on its own is a failure even with 0: the gateway lost it.
            stopping, failed = True, _exit_status(code) or 1
            stop_all()
        time.sleep(POLL_S)
    return failed or max(_exit_status(proc.returncode) for proc in procs)


def _exit_status(code: int | None) -> int:
    """A worker's return code as a process exit status: killed by signal N is 128 + N, as a
    shell reports it (returning -9 made the supervisor exit 247); 0 stays 0."""
    if code is None or code >= 0:
        return code or 0
    return 128 - code


def strangers(listen: str, looks: int = 3, between_s: float = 0.1) -> list[str]:
    """Who else listens where this worker has just bound `listen` (host:port), each said in
    words; [] when only this worker's siblings do (runtime/listeners.py says why it asks).

    Said only when `looks` looks `between_s` apart all find someone: the kernel's list of
    listeners and the processes' descriptors are read one after the other, and a socket
    closed between the two reads has no owner to be found. One make test run had a worker
    refuse a v4-mapped listener on its own port whose owner it could not see, while the
    only processes on that port were it and its sibling."""
    for _ in range(looks - 1):
        if not _strangers_now(listen):
            return []
        time.sleep(between_s)
    return _strangers_now(listen)


def _strangers_now(listen: str) -> list[str]:
    host, _, port = listen.rpartition(":")
    addresses = _addresses(host.strip("[]"))
    there = [
        listener
        for listener in listeners.listening(int(port))
        if any(listeners.overlaps(listener.address, a) for a in addresses)
    ]
    held = listeners.owners(listener.inode for listener in there)
    supervisor = int(os.environ.get(SUPERVISOR_ENV, "0"))
    said = []
    for listener in there:
        pid = held.get(listener.inode)
        if pid is None:
            said.append(
                f"a socket of a process this one cannot see (another user's, or another PID "
                f"namespace's: inode {listener.inode}, {listener.address})"
            )
        elif pid != os.getpid() and listeners.parent(pid) != supervisor:
            said.append(f"process {pid} ({listeners.command(pid)}) on {listener.address}")
    return said


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a listen host binds: itself, or what its name resolves to."""
    try:
        return [ipaddress.ip_address(host or "0.0.0.0")]
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return [ipaddress.ip_address(info[4][0]) for info in infos]
