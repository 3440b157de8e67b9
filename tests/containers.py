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

import pytest

from harness import SERVING, health
from hopline.runtime.service_table import SERVICES

IMAGE = os.environ.get("HOPLINE_IMAGE", "localhost/hopline:0.1.0")
IMAGE_UID = "10001"  # the image's user (deploy/image/Containerfile; runAsUser in deploy/k8s)
# crun refuses this host's hybrid cgroups; podman's default file and process limits are
# above what this host lets a process have, so the container gets this process's own.
NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)
# runc here refuses this process's own process limit (96k) but takes 32k.
NPROC = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
RUN = [
    "run", "-d", "--runtime", "runc", "--network", "host",
    "--ulimit", f"nofile={NOFILE[0]}:{NOFILE[1]}", "--ulimit", f"nproc={NPROC}:{NPROC}",
]  # fmt: skip


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
