"""Running the image's services as podman containers, for the tests in tests/deploy.

Containers share the host's network namespace on free loopback ports, so no container
network has to be set up.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence

import grpc
import pytest

from harness import SERVING, health
from hopline.cache.keys import answer_parameters
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime.service_table import SERVICES

IMAGE = os.environ.get("HOPLINE_IMAGE", "localhost/hopline:0.1.0")
IMAGE_UID = "10001"  # the image's user (deploy/image/Containerfile; runAsUser in deploy/k8s)
# crun refuses this host's hybrid cgroups; podman's default file and process limits are
# above what this host lets a process have, so the container gets this process's own.
NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)
# runc here refuses this process's own process limit (96k) but takes 32k.
NPROC = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
LIMITS = [
    "--runtime", "runc", "--network", "host",
    "--ulimit", f"nofile={NOFILE[0]}:{NOFILE[1]}", "--ulimit", f"nproc={NPROC}:{NPROC}",
]  # fmt: skip
RUN = ["run", "-d", *LIMITS]


def podman(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def require_image() -> None:
    if shutil.which("podman") is None:
        pytest.fail("podman is missing: `make image-smoke` installs it (Debian)")
    if subprocess.run(["podman", "image", "exists", IMAGE], check=False).returncode != 0:
        pytest.fail(f"{IMAGE} is missing: run `make image`")


def start(name: str, service: str, env: Mapping[str, str], extra: Sequence[str] = ()) -> None:
    """`service` from the image in container `name`, with `env` and podman's `extra` flags."""
    flags = [arg for key, value in env.items() for arg in ("-e", f"{key}={value}")]
    podman(*RUN, "--name", name, *flags, *extra, IMAGE, service)


def container_names(prefix: str) -> dict[str, str]:
    """service -> a container name of its own for this test run."""
    tag = uuid.uuid4().hex[:8]
    return {str(s.name): f"hopline-{prefix}-{s.name}-{tag}" for s in SERVICES}


def remove(names: Sequence[str]) -> None:
    for name in names:
        subprocess.run(["podman", "rm", "-f", "-t", "30", name], capture_output=True, check=False)


def logs(container: str, tail: int = 30) -> str:
    """The container's last lines (the services log to stderr, which `podman logs` gives
    back on its own stderr)."""
    out = subprocess.run(
        ["podman", "logs", "--tail", str(tail), container],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return (out.stdout + out.stderr).strip()


def wait_serving(addr: str, container: str, timeout_s: float = 180.0) -> None:
    """Until gRPC health at `addr` (plaintext) says SERVING; fails with the container's log
    if it stops first."""
    deadline = time.monotonic() + timeout_s
    while health(addr) != SERVING:
        state = podman("inspect", "-f", "{{.State.Status}}", container)
        if state != "running":
            raise AssertionError(f"{container} is {state} before SERVING:\n{logs(container)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{container} not SERVING within {timeout_s} s")
        time.sleep(0.5)


def stop_cleanly(container: str, service: str) -> None:
    """SIGTERM, then the exit code must be 0 (a drain, not a kill)."""
    podman("stop", "-t", "30", container)
    code = podman("inspect", "-f", "{{.State.ExitCode}}", container)
    assert code == "0", f"{service} exited {code}: {logs(container, 20)}"


def stored(
    cache: grpc.Channel, reply: gateway_pb2.PredictResponse, text: str, timeout_s: float = 30
) -> cache_pb2.LookupResponse:
    """The cache's own exact entry for the answer `reply` gave to `text`, under the scope the
    gateway files it in (gateway/call.py:PredictCall.new), once the gateway's store (sent
    after the reply) has landed. A repeat through the gateway cannot show this: its local
    tier answers a repeat from the moment it schedules the store."""
    scope = common_pb2.Scope(
        tenant=reply.tenant,
        model=reply.model,
        model_version=reply.model_version,
        parameters=answer_parameters(1, reply.model_digest),
    )
    lookup = cache_pb2.LookupRequest(scope=scope, text=text, mode="exact")
    stub = cache_pb2_grpc.CacheServiceStub(cache)
    deadline = time.monotonic() + timeout_s
    while True:
        found: cache_pb2.LookupResponse = stub.Lookup(lookup, timeout=timeout_s)
        if found.outcome == common_pb2.CACHE_OUTCOME_EXACT:
            return found
        assert time.monotonic() < deadline, "the gateway's store never reached the cache"
        time.sleep(0.1)
