"""What each service process loads, read from the running process itself.

`hopline serve gateway` and `hopline serve tokenizer` must load neither ONNX Runtime nor
pymilvus: each service imports its own code and nothing else, so a gateway replica starts
fast and stays small. Two views of the live process: /proc/PID/maps (every shared library it
mapped) and Python's own import log (PYTHONPROFILEIMPORTTIME prints every module imported).
The inference service, which does load ONNX Runtime, shows both views can see it. The same
processes show which threads read their sockets (HOPLINE_GRPC_IO).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import DEFAULT_MODEL
from harness import Mesh

HEAVY = ("onnxruntime", "pymilvus", "milvus_lite")
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)\s*$", re.MULTILINE)


def imported_modules(log: str) -> set[str]:
    return set(IMPORT_LINE.findall(log))


def mapped_files(pid: int) -> set[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6}


def heavy_in(names: set[str]) -> set[str]:
    return {n for n in names if any(h in n for h in HEAVY)}


@pytest.fixture(scope="module")
def services(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("imports")
    repo = work / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    profile = {"PYTHONPROFILEIMPORTTIME": "1"}
    mesh = Mesh(
        repo,
        work,
        service_env={name: profile for name in ("tokenizer", "inference", "gateway")},
    )
    try:
        yield mesh.start(("tokenizer", "inference", "gateway"))
    finally:
        mesh.stop()


# A module each service imports with an import statement (the service module itself comes
# through importlib, which the import log does not list): proof the log is being read.
OWN_MODULE = {"gateway": "hopline.gateway.upstream", "tokenizer": "hopline.model.tokenizer"}


@pytest.mark.parametrize("name", ["gateway", "tokenizer"])
def test_a_light_service_loads_neither_onnxruntime_nor_pymilvus(services: Mesh, name: str) -> None:
    modules = imported_modules(services.log(name))
    assert OWN_MODULE[name] in modules, f"no import log in {name}'s output"
    assert heavy_in(modules) == set(), f"{name} imported {sorted(heavy_in(modules))}"
    assert heavy_in(mapped_files(services.procs[name].pid)) == set()


def test_the_inference_service_shows_both_views_see_onnxruntime(services: Mesh) -> None:
    modules = imported_modules(services.log("inference"))
    assert "onnxruntime" in modules
    maps = heavy_in(mapped_files(services.procs["inference"].pid))
    assert any("onnxruntime" in path and path.endswith(".so") for path in maps), maps


@pytest.mark.parametrize("name", ["gateway", "tokenizer", "inference"])
def test_every_service_runs_on_uvloop(services: Mesh, name: str) -> None:
    """HOPLINE_EVENT_LOOP's default (runtime/event_loop.py): the loop that runs, not the
    setting, as the process's own log line and its mapped libraries show."""
    listening = [line for line in services.log(name).splitlines() if " listening " in line]
    assert listening, f"no listening line in {name}'s log"
    assert all("event_loop=uvloop" in line for line in listening), listening
    assert any("/uvloop/" in path for path in mapped_files(services.procs[name].pid))


def event_engine_wakeups(pid: int) -> int:
    """How often the process's gRPC EventEngine threads (named `event_engine`) were switched
    in: they read and write the sockets only where HOPLINE_GRPC_IO is `event-engine`."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "event_engine":
                continue
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended while being read
            continue
        total += sum(
            int(n) for n in re.findall(r"^\w*voluntary_ctxt_switches:\s+(\d+)$", status, re.M)
        )
    return total


# EventEngine threads reading the sockets wake 3-4 times a call; with iomgr only their timers
# wake them, 0.03-0.11 times a call on this project's VM when idle. The timers' wake-ups come
# with time, not with calls: on a loaded machine, where 300 calls take longer, they reached
# 1.19 a call in a CI-like run, so those of an equal stretch without calls are taken off.
ONE_A_CALL = 1.0


def wakeups_per_call(mesh: Mesh, name: str, calls: int = 300) -> float:
    pid = mesh.procs[name].pid
    with grpc.insecure_channel(mesh.addrs[name]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        before, started = event_engine_wakeups(pid), time.monotonic()
        for _ in range(calls):
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        during, took = event_engine_wakeups(pid) - before, time.monotonic() - started
        before = event_engine_wakeups(pid)
        time.sleep(took)
        idle = event_engine_wakeups(pid) - before
        per_call = (during - idle) / calls
        print(f"{name}: {per_call:.2f} EventEngine wake-ups a call ({during}, {idle} idle)")
        return per_call


@pytest.mark.parametrize("name", ["gateway", "tokenizer", "inference"])
def test_every_service_reads_its_sockets_on_the_thread_that_polls(
    services: Mesh, name: str
) -> None:
    """HOPLINE_GRPC_IO's default, iomgr (runtime/grpc_io.py): the process says so, and its
    EventEngine threads stay asleep while it answers."""
    listening = [line for line in services.log(name).splitlines() if " listening " in line]
    assert listening, f"no listening line in {name}'s log"
    assert all("grpc_io=iomgr" in line for line in listening), listening
    assert wakeups_per_call(services, name) < ONE_A_CALL


def test_event_engine_asked_for_wakes_those_threads_on_every_call(
    default_repo: Path, tmp_path: Path
) -> None:
    """The same count sees the other mode: a tokenizer started with HOPLINE_GRPC_IO=event-engine
    (grpcio's default) from this test process, which runs iomgr and passes that on."""
    mesh = Mesh(
        default_repo, tmp_path, service_env={"tokenizer": {"HOPLINE_GRPC_IO": "event-engine"}}
    )
    try:
        mesh.start(("tokenizer",))
        assert "grpc_io=event-engine" in mesh.log("tokenizer")
        assert wakeups_per_call(mesh, "tokenizer") >= ONE_A_CALL
    finally:
        mesh.stop()


def test_the_cache_user_command_loads_no_onnxruntime(tmp_path: Path) -> None:
    """`hopline cache milvus-user` (a Job or a one-shot container with a read-only root) reads
    the cache's config and talks to Milvus, nothing more: no ONNX Runtime, which would also
    try to write its telemetry id. Against a port nothing listens on, so it fails fast, as
    it says, after importing all it needs."""
    token = tmp_path / "token"
    token.write_text("hopline_cache:a-password\n")
    env = {
        **os.environ,
        "PYTHONPROFILEIMPORTTIME": "1",
        "HOPLINE_CACHE_URI": "http://127.0.0.1:9",
        "HOPLINE_CACHE_MILVUS_TOKEN_FILE": str(token),
        "HOPLINE_CACHE_MILVUS_TIMEOUT_S": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "hopline", "cache", "milvus-user", "--admin-token-file", str(token)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    modules = imported_modules(done.stderr)
    assert "pymilvus" in modules  # the import log is read, and it got as far as Milvus
    assert {m for m in modules if "onnxruntime" in m} == set()
