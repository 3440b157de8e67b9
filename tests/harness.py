"""The mesh launcher (hopline.runtime.launcher) with what tests add: free ports and a work
folder per mesh, quick start-up settings, and reads of the gateway's and cache's state."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime import launcher
from hopline.runtime.launcher import ALL, free_ports
from hopline.runtime.launcher import health_status as health

__all__ = ["ALL", "NOT_SERVING", "SERVING", "Mesh", "free_port", "health"]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Drain quickly (tests stop many meshes) and log for people reading a failure.
TEST_DEFAULTS = {"HOPLINE_LOG_FORMAT": "text", "HOPLINE_DRAIN_DELAY_S": "0.2"}


def free_port() -> int:
    """A loopback port free now and never handed out before in this test session."""
    return free_ports(1)[0]


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
        super().__init__(
            repo,
            addrs={name: f"127.0.0.1:{next(ports)}" for name in ALL} | (addrs or {}),
            # Each service's /metrics on its own port: the defaults would collide with a
            # `make run` on this machine and with the test session's other meshes.
            metrics_ports={name: next(ports) for name in ALL},
            env={**TEST_DEFAULTS, "HOPLINE_CACHE_URI": str(workdir / "cache.db"), **env},
            service_env=service_env,
            log_dir=workdir,
        )
        self.workdir = workdir

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
