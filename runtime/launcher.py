"""`hopline run` (what `make run` calls): the five services as child processes.

Children get SIGTERM when we stop (and, through PR_SET_PDEATHSIG, when we die without a
chance to clean up), so Ctrl-C never leaves orphans holding the ports.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hopline.runtime.config import DEFAULT_ADDRS, addr_env

log = logging.getLogger("hopline.run")

# Gateway last: it waits for inference anyway, but starting it last keeps the logs readable.
START_ORDER = ("tokenizer", "postprocess", "cache", "inference", "gateway")
STOP_TIMEOUT_S = 8.0


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now on `host`.

    All probe sockets stay open until every port is chosen: probing one at a time lets the
    kernel hand back a port it gave a moment ago, and two servers told the same port fail.
    """
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((host, 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def address(service: str) -> str:
    return os.environ.get(addr_env(service), DEFAULT_ADDRS[service])


def health_status(target: str, timeout_s: float = 1.0) -> int | None:
    """The grpc.health.v1 status of the server at `target`, or None if it does not answer."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
    except grpc.RpcError:
        return None
    return int(reply.status)


def is_serving(target: str, timeout_s: float = 1.0) -> bool:
    return health_status(target, timeout_s) == int(health_pb2.HealthCheckResponse.SERVING)


def start_service(
    name: str, env: dict[str, str], extra: list[str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "hopline", "serve", name, *(extra or [])],
        env=env,
        preexec_fn=_die_with_parent,
        process_group=0,  # Ctrl-C reaches only us; we stop the children in order.
    )


def stop_all(
    children: dict[str, subprocess.Popen[bytes]], timeout_s: float = STOP_TIMEOUT_S
) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for name, proc in children.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("did not drain in time; killing", extra={"service": name})
            proc.kill()
            proc.wait()


def run_mesh(model_repo: Path, log_format: str = "text", ready_timeout_s: float = 180.0) -> int:
    from hopline.observability.logs import setup_logging

    setup_logging("run", "info", log_format)
    if not model_repo.is_dir():
        log.error("no model repository; run `make model`", extra={"path": str(model_repo)})
        return 2
    env = dict(
        os.environ, HOPLINE_MODEL_REPO=str(model_repo.resolve()), HOPLINE_LOG_FORMAT=log_format
    )
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children = {name: start_service(name, env) for name in START_ORDER}
    gateway = address("gateway")
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not stopping and not is_serving(gateway):
            dead = {n: p.returncode for n, p in children.items() if p.poll() is not None}
            if dead:
                log.error("service exited during start-up", extra={"exit_codes": dead})
                return 1
            if time.monotonic() > deadline:
                log.error("gateway not SERVING in time", extra={"timeout_s": ready_timeout_s})
                return 1
            time.sleep(0.3)
        if not stopping:
            sys.stdout.write(
                f"\nhopline is up: gateway SERVING on {gateway}\n"
                f'  try: .venv/bin/hopline predict "I forgot my password"\n'
                f"  stop: Ctrl-C\n\n"
            )
            sys.stdout.flush()
        while not stopping:
            dead = {n: p.returncode for n, p in children.items() if p.poll() is not None}
            if dead:
                log.error("service exited; stopping the mesh", extra={"exit_codes": dead})
                return 1
            time.sleep(0.3)
        return 0
    finally:
        log.info("stopping the mesh")
        stop_all(children)
