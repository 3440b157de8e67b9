"""Start real hopline service processes on free loopback ports, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.launcher import health_status as health

ALL = ("tokenizer", "postprocess", "cache", "inference", "gateway")


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before in this test session.

    The kernel may return a port it gave us a moment ago once that probe socket is closed;
    two services told the same port would both fail or, worse, split one port's traffic.
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Mesh:
    def __init__(
        self,
        repo: Path,
        workdir: Path,
        service_env: dict[str, dict[str, str]] | None = None,
        addrs: dict[str, str] | None = None,
        **env: str,
    ) -> None:
        self.service_env = service_env or {}
        self.repo = repo
        self.workdir = workdir
        # `addrs` overrides some, e.g. unix:PATH sockets for co-located services.
        self.addrs = {name: f"127.0.0.1:{free_port()}" for name in ALL} | (addrs or {})
        # Each service's /metrics on its own free port: the defaults would collide with a
        # `make run` on the same machine and with other meshes of the test session.
        self.metrics_ports = {name: free_port() for name in ALL}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        defaults = {
            "HOPLINE_LOG_FORMAT": "text",
            "HOPLINE_DRAIN_DELAY_S": "0.2",
            # Each mesh gets its own milvus-lite file: one process per database file.
            "HOPLINE_CACHE_URI": str(workdir / "cache.db"),
        }
        self.env = {**os.environ, **defaults, "HOPLINE_MODEL_REPO": str(repo), **env}
        for name, addr in self.addrs.items():
            self.env[f"HOPLINE_{name.upper()}_ADDR"] = addr

    @property
    def gateway(self) -> str:
        return self.addrs["gateway"]

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, names: tuple[str, ...] = ALL, timeout_s: float = 120.0) -> Mesh:
        self.spawn(names)
        for name in names:
            self.wait_serving(name, timeout_s)
        if {"gateway", "cache"} <= set(names) and self._env(
            "gateway", "HOPLINE_GATEWAY_EXACT_ENTRIES"
        ) != "0":
            self.wait_local_tier(timeout_s)
        return self

    def _env(self, service: str, name: str) -> str | None:
        return self.service_env.get(service, {}).get(name, self.env.get(name))

    def wait_local_tier(self, timeout_s: float = 120.0) -> None:
        """Until the gateway's local exact tier is live (its watch on the cache connected).

        Without it, what a test stores right after start-up is not copied locally, and
        whether a repeat is answered by the gateway or by the cache depends on timing.
        """
        deadline = time.monotonic() + timeout_s
        while self.gateway_counters().get("local_exact_live") != 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway exact tier not live:\n{self.log('gateway')}")
            time.sleep(0.05)

    def spawn(self, names: tuple[str, ...]) -> None:
        """Start the processes without waiting for them to serve."""
        for name in names:
            with (self.workdir / f"{name}.log").open("ab") as out:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "hopline", "serve", name],
                    env={
                        **self.env,
                        "HOPLINE_METRICS_PORT": str(self.metrics_ports[name]),
                        **self.service_env.get(name, {}),
                    },
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

    def wait_serving(self, name: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while health(self.addrs[name]) != SERVING:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not SERVING after {timeout_s}s:\n{self.log(name)}")
            time.sleep(0.2)

    def gateway_counters(self) -> dict[str, int | str]:
        """The gateway's GetStats counters, plus its cache circuit state as `circuit`."""
        with grpc.insecure_channel(self.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            stats = stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=10)
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
            if idle and self.cache_stats().pending_writes == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"cache stores did not land within {timeout_s} s")

    def terminate(self, name: str, timeout_s: float = 15.0) -> int:
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout_s)

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
