"""The mesh launcher (hopline.runtime.launcher) with what tests add: free ports and a work
folder per mesh, quick start-up settings, and reads of the gateway's and cache's state."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2
from milvus_server import MilvusKind, MilvusServer, chosen_kind, lane_env

from hopline.cache.keys import answer_parameters
from hopline.model.repository import version_digest
from hopline.observability.jaeger import get_json
from hopline.observability.report import Span, parse_otlp
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime import launcher
from hopline.runtime.api_keys import operator_metadata
from hopline.runtime.launcher import ALL, rpcs_answered
from hopline.runtime.launcher import health_status as health
from hopline.runtime.ports import free_ports
from hopline.runtime.service_table import Topology, spec

__all__ = [
    "ALL",
    "NOT_SERVING",
    "SERVING",
    "TOPOLOGIES",
    "Mesh",
    "SecondReplica",
    "Topology",
    "beside_faulty_inference",
    "beside_second_replica",
    "free_port",
    "health",
    "rpcs_answered",
    "served_ok",
    "spawn_replica",
]

# A test module that must pass in every placement says `MESH_TOPOLOGIES = TOPOLOGIES`
# (conftest.py:pytest_generate_tests).
# The end-to-end suites run on both shapes operators deploy. One process (the cache in the
# gateway too) has no cache address for the tests' own cache calls; tests/mesh/
# test_colocation.py runs a request's whole path, local tier included, in that shape.
TOPOLOGIES = (Topology.FIVE_PROCESS, Topology.COLOCATED)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Drain quickly (tests stop many meshes) and log for people reading a failure.
TEST_DEFAULTS = {"HOPLINE_LOG_FORMAT": "text", "HOPLINE_DRAIN_DELAY_S": "0.2"}


def _home(workdir: Path) -> Path:
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    return home


def free_port() -> int:
    """A loopback port free now and never handed out before in this test session."""
    return free_ports(1)[0]


def eventually(
    check: Callable[[], bool], what: str, timeout_s: float = 30.0, every_s: float = 0.2
) -> None:
    """Call `check` until it holds; fail saying `what` did not happen within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(every_s)


def answer_scope(repo: Path, tenant: str, model: str, version: str) -> common_pb2.Scope:
    """The scope the gateway files its top-1 answers in for `model`/`version` of `repo`
    (gateway/call.py:_Scopes): the version's files' digest is part of it."""
    digest = version_digest(repo / model / version)
    return common_pb2.Scope(
        tenant=tenant, model=model, model_version=version, parameters=answer_parameters(1, digest)
    )


class Mesh(launcher.Mesh):
    """Services on free loopback ports over `repo`, each logging to `workdir/<name>.log`."""

    def __init__(
        self,
        repo: Path,
        workdir: Path,
        service_env: dict[str, dict[str, str]] | None = None,
        addrs: dict[str, str] | None = None,
        **env: str,
    ) -> None:
        # `addrs` overrides some, e.g. unix:PATH sockets for co-located services.
        ports = iter(free_ports(2 * len(ALL)))
        # HOPLINE_TEST_MILVUS=lite-server|standalone: this mesh's cache reaches a Milvus
        # server of its own by URI instead of milvus-lite by file (tests/milvus_server.py).
        kind = chosen_kind()
        self.milvus: MilvusServer | None = None
        if kind is not MilvusKind.FILE and "HOPLINE_CACHE_URI" not in env:
            self.milvus = MilvusServer(workdir / "milvus", kind)
            # With a server URI the verifier's state would default to the shared work dir.
            verify = str(workdir / "cache.verify.sqlite")
            env = {
                "HOPLINE_CACHE_VERIFY_STATE": verify,
                **lane_env(kind),
                **env,
                "HOPLINE_CACHE_URI": self.milvus.uri,
            }
        super().__init__(
            repo,
            addrs={name: f"127.0.0.1:{next(ports)}" for name in ALL} | (addrs or {}),
            # Each service's /metrics on its own port: the defaults would collide with a
            # `make run` on this machine and with the test session's other meshes.
            metrics_ports={name: next(ports) for name in ALL},
            env={
                **TEST_DEFAULTS,
                "HOPLINE_CACHE_URI": str(workdir / "cache.db"),
                # milvus-lite keeps files under $HOME/.cache/milvus and creates that folder
                # at start: meshes of one test run starting and stopping at once shared it,
                # and a start lost the race ('create dir:/root/.cache/milvus failed', then
                # "Mmap manager has not been init"). Each mesh has its own.
                "HOME": str(_home(workdir)),
                **env,
            },
            service_env=service_env,
            log_dir=workdir,
        )
        self.workdir = workdir

    def start(
        self,
        names: Iterable[str] = ALL,
        timeout_s: float = 120.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> Self:
        if self.milvus is not None and self.milvus.process is None:
            self.milvus.start()
        return super().start(names, timeout_s, stopping)

    def stop(self, timeout_s: float = launcher.STOP_TIMEOUT_S) -> None:
        super().stop(timeout_s)
        if self.milvus is not None:
            self.milvus.stop()

    def gateway_counters(self) -> dict[str, int | str]:
        """The gateway's GetStats counters, plus its cache circuit state as `circuit`."""
        with grpc.insecure_channel(self.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            # As the launcher asks: with the keys file's first key when keys are set.
            stats = stub.GetStats(
                gateway_pb2.GetStatsRequest(), timeout=10, metadata=operator_metadata(self.env)
            )
            return {**stats.counters, "circuit": stats.cache_circuit}

    def cache_stats(self) -> cache_pb2.GetStatsResponse:
        with grpc.insecure_channel(self.addrs["cache"]) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            stats: cache_pb2.GetStatsResponse = stub.GetStats(
                cache_pb2.GetStatsRequest(), timeout=10
            )
            return stats

    def settle(self, timeout_s: float = 20.0) -> None:
        """Wait until every store the gateway sent has been written to Milvus.

        Stores are off the reply's path, so a test that expects a hit must wait for them
        rather than sleep: a loaded CI machine can take far longer than a sleep assumes.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            idle = self.gateway_counters()["stores_in_flight"] == 0
            # A co-located cache has no port to ask; its accepted stores already answer.
            if idle and (self.colocated("cache") or self.cache_stats().pending_writes == 0):
                return
            time.sleep(0.05)
        raise AssertionError(f"cache stores did not land within {timeout_s} s")


def spawn_replica(
    mesh: Mesh,
    name: str,
    port: int,
    metrics_port: int,
    env: dict[str, str],
    label: str,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Another replica of `name` on `host:port` (any 127.x.y.z is loopback too), with
    `mesh`'s environment plus `env`, returned once its health says SERVING. Its log is
    `mesh.workdir/<name>-<label>.log`. `prefix`: a command that execs the service (`prlimit
    ...`)."""
    log_path = mesh.workdir / f"{name}-{label}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "hopline", "serve", name],
            env={
                **mesh.env,
                f"HOPLINE_{name.upper()}_ADDR": f"{host}:{port}",
                "HOPLINE_METRICS_PORT": str(metrics_port),
                **env,
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    deadline = time.monotonic() + 120
    while health(f"{host}:{port}") != SERVING:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the {label} {name} never said SERVING: {log_path.read_text()}")
        time.sleep(0.1)
    return proc


def served_ok(metrics_port: int, method: str = "") -> float:
    """RPCs a service process answered OK (of `method` only, where given)."""
    return rpcs_answered(metrics_port, method, "OK")


@dataclasses.dataclass
class SecondReplica:
    """The replica a test started beside a mesh's own (`beside_second_replica`)."""

    proc: subprocess.Popen[bytes]
    metrics_port: int


@contextlib.contextmanager
def beside_second_replica(
    repo: Path,
    workdir: Path,
    service: str,
    replica_env: dict[str, str],
    label: str,
    gateway_env: dict[str, str],
) -> Iterator[tuple[Mesh, SecondReplica]]:
    """A started mesh over `repo` (no cache) whose gateway round-robins, over one channel,
    between its own `service` and a second replica started with `replica_env` as well, on
    one ONNX Runtime thread each (the two share the cores). Yields the mesh and that replica;
    stops both after (a test may kill the replica first)."""
    own, second, second_metrics = free_port(), free_port(), free_port()
    mesh = Mesh(
        repo,
        workdir,
        addrs={service: f"127.0.0.1:{own}"},
        service_env={
            "gateway": {
                spec(service).addr_env: f"ipv4:127.0.0.1:{own},127.0.0.1:{second}",
                "HOPLINE_CHANNELS_PER_UPSTREAM": "1",
                **gateway_env,
            }
        },
        HOPLINE_INFERENCE_THREADS="1",
    )
    proc = spawn_replica(mesh, service, second, second_metrics, replica_env, label)
    try:
        mesh.start(("tokenizer", "inference", "postprocess", "gateway"))
        yield mesh, SecondReplica(proc, second_metrics)
    finally:
        mesh.stop()
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def beside_faulty_inference(
    default_repo: Path, workdir: Path, model: str, code: str, gateway_env: dict[str, str]
) -> Iterator[tuple[Mesh, int]]:
    """`beside_second_replica` of inference, the second one failing every call with `code`
    (HOPLINE_TEST_FAULT, test-only), SERVING all the same, as a replica with a broken model,
    or one stopping, would be. Yields the mesh and the faulty replica's metrics port."""
    repo = workdir / "models"
    shutil.copytree(default_repo / model, repo / model)
    fault = {"HOPLINE_TEST_FAULT": code}
    with beside_second_replica(repo, workdir, "inference", fault, "faulty", gateway_env) as (
        mesh,
        faulty,
    ):
        yield mesh, faulty.metrics_port


def add_model(repo: Path, source: Path, name: str, version: str, **cache: Any) -> None:
    """A copy of `source` published as name/version with its own cache policy."""
    target = repo / name / version
    shutil.copytree(source, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["name"], cfg["version"] = name, version
    cfg["cache"].update(cache)
    (target / "config.json").write_text(json.dumps(cfg))


def fetch_trace(base: str, trace_id: str, want_services: int, timeout_s: float = 30) -> list[Span]:
    """The trace's spans once its root and `want_services` services have reported."""
    deadline = time.monotonic() + timeout_s
    spans: list[Span] = []
    while time.monotonic() < deadline:
        try:
            doc = get_json(f"{base}/api/v3/traces/{trace_id}")
            spans = parse_otlp([doc]).get(trace_id, [])
        except urllib.error.HTTPError as err:
            if err.code != 404:
                raise
        # Each service exports in its own batches: the gateway's root span ends last and can
        # arrive a batch after its client spans, so wait for the root too.
        rooted = any(not s.parent_id for s in spans)
        if rooted and len({s.service for s in spans}) >= want_services:
            return spans
        time.sleep(0.2)
    raise AssertionError(
        f"trace {trace_id}: {len(spans)} spans from { ({s.service for s in spans}) }"
    )


def serve_refused(name: str, env: Mapping[str, str]) -> str:
    """`hopline serve NAME` under `env`, expected to refuse to start: asserts it exited with 2
    (a setting that cannot work) and returns what it said."""
    done = subprocess.run(
        [sys.executable, "-m", "hopline", "serve", name],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    return done.stdout + done.stderr
