"""Start real hopline service processes on free loopback ports, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from hopline.supervisor import health_status as health

ALL = ("tokenizer", "postprocess", "cache", "inference", "gateway")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Mesh:
    def __init__(
        self,
        repo: Path,
        workdir: Path,
        service_env: dict[str, dict[str, str]] | None = None,
        **env: str,
    ) -> None:
        self.service_env = service_env or {}
        self.repo = repo
        self.workdir = workdir
        self.addrs = {name: f"127.0.0.1:{free_port()}" for name in ALL}
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
        for name in names:
            self.wait_serving(name, timeout_s)
        return self

    def wait_serving(self, name: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while health(self.addrs[name]) != SERVING:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not SERVING after {timeout_s}s:\n{self.log(name)}")
            time.sleep(0.2)

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
