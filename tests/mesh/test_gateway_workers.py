"""Several gateway processes on one port (HOPLINE_GATEWAY_WORKERS, runtime/workers.py): the
kernel spreads connections over them and each answers as the one gateway would; SIGTERM to
the gateway drains them all; a worker that dies takes the gateway down with it, so its
orchestrator restarts it; settings that cannot work are refused by name. Two workers on this
2-core machine prove the behaviour, not a speed-up (that needs spare cores)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness import Mesh, free_port, rpcs_answered, serve_refused, served_ok
from hopline.bench.cli import bench_once
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.launcher import ALL
from hopline.runtime.workers import METRICS_DIR_ENV, WORKER_ENV

WORKERS = 2


def _workers(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: it serves nothing.
    return "zombie" not in Path(f"/proc/{pid}/status").read_text()


def _start(repo: Path, work: Path) -> Mesh:
    mesh = Mesh(repo, work, service_env={"gateway": {"HOPLINE_GATEWAY_WORKERS": str(WORKERS)}})
    mesh.start()
    # The mesh is up once one worker serves the port (health answers from it); each worker
    # binds once it is ready, so the others may still be loading. The tests want them all.
    deadline = time.monotonic() + 60
    while not all(f"worker={i}" in _listening(mesh) for i in range(WORKERS)):
        assert time.monotonic() < deadline, mesh.log("gateway")
        time.sleep(0.1)
    return mesh


def _listening(mesh: Mesh) -> str:
    """The gateway log's lines saying a worker bound the port."""
    return "\n".join(line for line in mesh.log("gateway").splitlines() if "listening" in line)


@pytest.fixture
def mesh(default_repo: Path, tmp_path: Path) -> Iterator[Mesh]:
    m = _start(default_repo, tmp_path)
    try:
        yield m
    finally:
        m.stop()


def _announced_ports(mesh: Mesh) -> list[int]:
    """The /metrics port each worker announced (its environment names the folder)."""
    ports = []
    for pid in _workers(mesh.procs["gateway"].pid):
        environ = dict(
            entry.split("=", 1)
            for entry in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in entry
        )
        index = environ[WORKER_ENV]
        ports.append((int(index), int((Path(environ[METRICS_DIR_ENV]) / index).read_text())))
    assert sorted(i for i, _ in ports) == list(range(WORKERS))
    return [port for _, port in sorted(ports)]


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
        return text


def _predict(target: str, text: str) -> gateway_pb2.PredictResponse:
    with grpc.insecure_channel(target) as channel:  # a connection of its own
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text=text), timeout=30
        )
        return reply


def test_every_worker_answers_on_the_one_port(mesh: Mesh) -> None:
    workers = _workers(mesh.procs["gateway"].pid)
    assert len(workers) == WORKERS
    answers = {_predict(mesh.gateway, "i forgot my password").prediction.label}
    # Connections are spread by a hash of their addresses: in 24 fresh ones, each of two
    # workers gets some unless the kernel stopped spreading (a chance of 2 in 2**24).
    for _ in range(24):
        answers.add(_predict(mesh.gateway, "i forgot my password").prediction.label)
    assert len(answers) == 1  # one model, one answer, whichever worker gave it
    # Each worker serves its own /metrics on a loopback port the kernel picked (none of the
    # ports after the gateway's, where the next services listen), announced to the supervisor.
    own = _announced_ports(mesh)
    base = mesh.metrics_ports["gateway"]
    assert not set(own) & {base + 1 + i for i in range(WORKERS)}, own
    served = [served_ok(port, "Predict") for port in own]
    assert sum(served) == 25
    assert all(n > 0 for n in served), served
    # The gateway's own metrics port: every worker's series, each labelled with its worker.
    assert served_ok(base, "Predict") == 25
    merged = _metrics(base)
    for i, n in enumerate(served):
        assert f'hopline_worker_up{{worker="{i}"}} 1.0' in merged
        assert rpcs_answered(base, "Predict", "OK", worker=str(i)) == n
    # `hopline bench --connections` spreads its calls the same way.
    run = bench_once(
        "--target", mesh.gateway, "--connections", "16", "--concurrency", "4",
        "--duration", "1", "--warmup", "0", "--mix", "exact", "--baseline", "none",
    )  # fmt: skip
    assert run["targets"]["mesh"]["errors"] == 0
    after = [served_ok(port, "Predict") for port in own]
    assert all(a > b for a, b in zip(after, served, strict=True)), (served, after)


def test_sigterm_drains_every_worker(mesh: Mesh) -> None:
    workers = _workers(mesh.procs["gateway"].pid)
    assert _predict(mesh.gateway, "where is my order").prediction.label
    assert mesh.terminate("gateway") == 0
    assert not [pid for pid in workers if _alive(pid)]


@pytest.mark.parametrize("which", [0, -1])
def test_a_worker_that_dies_takes_the_gateway_down(mesh: Mesh, which: int) -> None:
    """Whichever worker dies (before, one after the first running one was never polled: the
    gateway served on with fewer workers, silently); the supervisor exits as a shell reports
    a kill (128 + 9; it exited 247 from -9)."""
    gateway = mesh.procs["gateway"]
    workers = _workers(gateway.pid)
    killed = workers[which]
    os.kill(killed, signal.SIGKILL)
    assert gateway.wait(timeout=30) == 128 + signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid)]
    assert "worker exited; stopping the others" in mesh.log("gateway")


def test_a_supervisor_killed_outright_takes_its_workers_along(mesh: Mesh) -> None:
    gateway = mesh.procs["gateway"]
    workers = _workers(gateway.pid)
    gateway.kill()
    gateway.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid)]


@pytest.mark.parametrize(
    ("addr", "workers", "says"),
    [
        ("127.0.0.1:0", WORKERS, "needs a fixed TCP port to share"),
        ("unix:/tmp/hopline-gateway.sock", WORKERS, "needs a fixed TCP port to share"),
        ("taken", WORKERS, "address in use"),
        ("taken", 0, "HOPLINE_GATEWAY_WORKERS=0: at least 1 process must serve"),
        # A traceback (OverflowError) before: the port was probed before it was checked.
        ("127.0.0.1:99999", WORKERS, "'127.0.0.1:99999': the port must be a number from 0"),
        # Each worker opened the same milvus-lite file: all but one failed, the gateway
        # served on with fewer (or said the file was damaged).
        ("colocated", WORKERS, "milvus-lite serves one process a file"),
    ],
)
def test_settings_workers_cannot_share_are_refused(addr: str, workers: int, says: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        colocated = {}
        if addr == "taken":
            addr = f"127.0.0.1:{holder.getsockname()[1]}"
        elif addr == "colocated":
            addr = f"127.0.0.1:{free_port()}"
            colocated = {"HOPLINE_CACHE_ADDR": "inproc", "HOPLINE_CACHE_URI": "/tmp/x.db"}
        env = {
            **os.environ,
            "HOPLINE_GATEWAY_ADDR": addr,
            "HOPLINE_GATEWAY_WORKERS": str(workers),
            "HOPLINE_LOG_FORMAT": "text",
            **colocated,
        }
        said = serve_refused("gateway", env)
    assert says in said


def test_a_process_that_takes_the_port_while_the_workers_start_stops_the_gateway(
    default_repo: Path, tmp_path: Path
) -> None:
    """The supervisor finds the port free, but its workers bind it only once ready, seconds
    later. A process that binds it meanwhile with SO_REUSEPORT (gRPC servers set it by
    default; here the test's own socket) would share the gateway's connections: the first
    worker to bind sees it and the gateway exits 2 naming it. Before, it served on beside it."""
    mesh = Mesh(
        default_repo, tmp_path, service_env={"gateway": {"HOPLINE_GATEWAY_WORKERS": str(WORKERS)}}
    )
    host, _, port = mesh.addrs["gateway"].rpartition(":")
    try:
        mesh.spawn(["gateway"])
        deadline = time.monotonic() + 60
        while "workers started" not in mesh.log("gateway"):  # the supervisor's check passed
            assert mesh.procs["gateway"].poll() is None, mesh.log("gateway")
            assert time.monotonic() < deadline, mesh.log("gateway")
            time.sleep(0.05)
        with socket.socket() as stranger:
            stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            stranger.bind((host, int(port)))
            stranger.listen()
            # The workers wait for their upstreams before they bind.
            mesh.spawn([name for name in ALL if name != "gateway"])
            code = mesh.procs["gateway"].wait(timeout=120)
        said = mesh.log("gateway")
        assert code == 2, said
        assert "address in use" in said
        assert f"process {os.getpid()} (" in said, said
    finally:
        mesh.stop()


def test_each_worker_logs_the_pool_sizes_it_inherits(tmp_path: Path) -> None:
    """A gateway pinned to one CPU sizes the libraries' pools to it before its workers start;
    each worker inherits them and sets none itself, so its `cpus` record says what is in
    effect (`pool_env`) as well as what it set (`pools`: nothing). It used to say only
    `pools={}`."""
    from hopline.runtime.cpu_quota import POOL_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in POOL_VARIABLES}
    env |= {
        "HOPLINE_GATEWAY_ADDR": f"127.0.0.1:{free_port()}",
        "HOPLINE_GATEWAY_WORKERS": str(WORKERS),
        "HOPLINE_LOG_FORMAT": "json",
        "HOPLINE_METRICS_PORT": "0",
    }
    cpu = min(os.sched_getaffinity(0))
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            ["taskset", "-c", str(cpu), sys.executable, "-m", "hopline", "serve", "gateway"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while len(records := _cpus_records(log_path)) < WORKERS:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    ones = dict.fromkeys(POOL_VARIABLES, "1")
    for record in records:
        assert record["usable"] == 1
        assert record["pools"] == {}
        assert record["pool_env"] == ones


def _cpus_records(log_path: Path) -> list[dict[str, Any]]:
    lines = log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [record for record in records if record.get("msg") == "cpus"]
