"""The image `make image` builds, run as containers: every service reaches gRPC health
SERVING, the five together answer a Predict (a miss, then an exact hit from the cache), each
runs as the image's non-root user, and each drains to exit code 0 on SIGTERM; a container
given a CPU limit sizes its threads to it.

Run by `make image-smoke` only (tests/deploy is outside the default lanes): it needs podman,
runc and the built image, which `make image` provides. Containers share the host's network
namespace on free loopback ports, so no container network has to be set up.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator

import grpc
import pytest

from containers import (
    IMAGE,
    IMAGE_UID,
    LIMITS,
    container_names,
    podman,
    remove,
    require_image,
    start,
    stop_cleanly,
    stored,
    wait_serving,
)
from harness import SERVING, free_port, health
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.service_table import SERVICES, ServiceName

UPSTREAMS = [s.name for s in SERVICES if s.name != ServiceName.GATEWAY]
EXACT = common_pb2.CACHE_OUTCOME_EXACT


@pytest.fixture(scope="module")
def containers() -> Iterator[dict[str, str]]:
    """name -> address of the five services, each in a container of its own."""
    require_image()
    addrs = {str(s.name): f"127.0.0.1:{free_port()}" for s in SERVICES}
    dial = {f"HOPLINE_{name.upper()}_ADDR": addrs[name] for name in UPSTREAMS}
    names = container_names("smoke")
    try:
        for service in SERVICES:
            env = {f"HOPLINE_{service.name.upper()}_ADDR": addrs[service.name]}
            env |= {"HOPLINE_METRICS_PORT": "0", "HOPLINE_DRAIN_DELAY_S": "0.2"}
            if service.name == ServiceName.GATEWAY:
                env |= dial
            start(names[service.name], service.name, env)
            if service.name != ServiceName.GATEWAY:
                wait_serving(addrs[service.name], names[service.name])
        wait_serving(addrs[ServiceName.GATEWAY], names[ServiceName.GATEWAY])
        yield {**addrs, **{f"{name}:container": names[name] for name in names}}
    finally:
        remove(list(names.values()))


def test_every_service_is_serving_as_the_image_user(containers: dict[str, str]) -> None:
    for service in SERVICES:
        assert health(containers[service.name]) == SERVING, service.name
        container = containers[f"{service.name}:container"]
        assert podman("exec", container, "id", "-u") == IMAGE_UID, service.name


def test_a_mesh_of_containers_answers_a_predict(containers: dict[str, str]) -> None:
    text = "I was charged twice for one order"
    with grpc.insecure_channel(containers[ServiceName.GATEWAY]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        first = stub.Predict(gateway_pb2.PredictRequest(text=text), timeout=60)
        assert first.prediction.label
        assert first.cache.outcome == common_pb2.CACHE_OUTCOME_MISS
        with grpc.insecure_channel(containers[ServiceName.CACHE]) as to_cache:
            assert stored(to_cache, first, text).prediction.label == first.prediction.label
        again = stub.Predict(gateway_pb2.PredictRequest(text=text), timeout=60)
        assert again.cache.outcome == EXACT
        assert again.prediction.label == first.prediction.label


def test_each_container_drains_to_exit_code_zero(containers: dict[str, str]) -> None:
    for service in reversed(SERVICES):  # the gateway first, as a rollout would
        stop_cleanly(containers[f"{service.name}:container"], service.name)


def test_a_container_with_a_cpu_limit_sizes_its_threads_to_it() -> None:
    """`--cpus 1` (a CFS quota on the container's cgroup, as Kubernetes' `limits.cpu` sets):
    the inference service counts one CPU, whatever the machine has, and sizes the libraries'
    pools to it (runtime/cpu_quota.py); it still serves."""
    addr = f"127.0.0.1:{free_port()}"
    name = f"hopline-smoke-cpus-{uuid.uuid4().hex[:8]}"
    env = {"HOPLINE_INFERENCE_ADDR": addr, "HOPLINE_METRICS_PORT": "0"}
    try:
        start(name, ServiceName.INFERENCE, env, ["--cpus", "1"])
        wait_serving(addr, name)
        # The services log to stderr, which `podman logs` gives back on its own stderr.
        logs = subprocess.run(
            ["podman", "logs", name], capture_output=True, text=True, timeout=60, check=True
        ).stderr.splitlines()
        records = [json.loads(line) for line in logs if line.startswith("{")]
        cpus = [record for record in records if record.get("msg") == "cpus"]
        assert cpus, "\n".join(logs[-30:])
        assert cpus[0]["quota"] == 1.0
        assert cpus[0]["usable"] == 1
        assert cpus[0]["pools"] == {
            "RAYON_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
    finally:
        remove([name])


def test_the_cache_milvus_user_command_runs_from_the_image() -> None:
    """The one-shot milvus-cache-user (compose.mtls.yaml; the production overlay's Job) runs
    the image with its entrypoint replaced by `hopline cache milvus-user`, as the image's
    user, with a read-only root and nothing writable (as Kubernetes runs it): the command is
    there, and a missing token file is one line, not a traceback. (No Milvus runs in a
    container here; tests/deploy/test_cache_milvus_security.py runs the command against
    one.)"""
    require_image()
    # No tmpfs on /tmp either (podman's --read-only mounts one unless told not to): the Job's
    # pod has none, and a temporary folder looked for at import failed it there.
    read_only = ["--read-only", "--read-only-tmpfs=false"]
    command = ["run", "--rm", *LIMITS, "--entrypoint", "hopline", *read_only, IMAGE]
    command += ["cache", "milvus-user"]
    assert "--admin-token-file" in podman(*command, "--help")
    out = subprocess.run(
        ["podman", *command, "--admin-token-file", "/nowhere/token"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), out.stderr
    assert "/nowhere/token" in last, out.stderr
    assert "Traceback" not in out.stderr
