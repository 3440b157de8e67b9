"""The gateway calls only replicas whose health says SERVING (gRPC's client-side health
checking, gateway/upstream.py:HEALTH_CHECKED).

A replica reports NOT_SERVING while it still accepts calls in two moments of a rollout: from
binding its port until its models are loaded (it answers "starting up", UNAVAILABLE), and for
HOPLINE_DRAIN_DELAY_S after SIGTERM. The second is held open here for long enough to measure:
one of two inference replicas is told to stop with a 60 s drain delay, and while it says
NOT_SERVING (but would answer) the gateway's traffic must all go to the other one.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import DEFAULT_MODEL
from harness import NOT_SERVING, Mesh, free_port, health, served_ok, spawn_replica
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.server import MAX_INFRA_STREAMS

REQUESTS = 60
LEAN = {"HOPLINE_INFERENCE_THREADS": "1"}


def predict_all(gateway: str, count: int) -> list[str]:
    """`count` Predicts that each reach inference (new texts, cache bypassed); their labels."""
    labels = []
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for _ in range(count):
            reply = stub.Predict(
                gateway_pb2.PredictRequest(
                    text=f"where is my order {uuid.uuid4()}",
                    cache_mode=common_pb2.CACHE_MODE_BYPASS,
                ),
                timeout=10,
            )
            labels.append(reply.prediction.label)
    return labels


def start_draining(replica: subprocess.Popen[bytes], port: int) -> None:
    """SIGTERM to `replica`, back once its health says NOT_SERVING (it still accepts, for its
    drain delay) and the gateway's health watches have had time to hear it."""
    replica.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while health(f"127.0.0.1:{port}") != NOT_SERVING:
        assert time.monotonic() < deadline, "the replica never said NOT_SERVING"
        time.sleep(0.05)
    time.sleep(0.5)


def test_a_replica_that_says_not_serving_gets_no_calls(default_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    own, other, other_metrics = free_port(), free_port(), free_port()
    addrs = f"127.0.0.1:{own},127.0.0.1:{other}"
    mesh = Mesh(
        repo,
        tmp_path,
        addrs={"inference": f"127.0.0.1:{own}"},
        service_env={"gateway": {"HOPLINE_INFERENCE_ADDR": f"ipv4:{addrs}"}},
        **LEAN,
    )
    # NOT_SERVING yet accepting, once told to stop, for the rest of the test.
    drain = {"HOPLINE_DRAIN_DELAY_S": "60"}
    second = spawn_replica(mesh, "inference", other, other_metrics, drain, "second")
    try:
        mesh.start(("tokenizer", "inference", "postprocess", "gateway"))
        predict_all(mesh.gateway, REQUESTS)
        assert served_ok(other_metrics, "Infer") > 0, "the second replica took no calls at all"

        start_draining(second, other)
        before = served_ok(other_metrics, "Infer")
        labels = predict_all(mesh.gateway, REQUESTS)
        assert len(labels) == REQUESTS
        assert all(labels)
        assert second.poll() is None, "the replica stopped accepting before the test ended"
        assert served_ok(other_metrics, "Infer") == before, (
            "the gateway called a replica whose health said NOT_SERVING"
        )
    finally:
        mesh.stop()
        second.kill()
        second.wait()


def test_a_lone_replica_that_drains_is_called_through_its_drain_delay(
    default_repo: Path, tmp_path: Path
) -> None:
    """With no other replica to move to, a draining one that still accepts is called: the
    delay is there so callers with another replica move away, and a gateway whose only
    replica said NOT_SERVING failed every call at once (an operator's probe: a graceful
    SIGTERM of the one cache replica failed the stores of the 0.35 s before it stopped
    accepting; gateway/upstream.py:Upstream, its last-resort channel)."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    port, metrics_port = free_port(), free_port()
    mesh = Mesh(repo, tmp_path, None, {"inference": f"127.0.0.1:{port}"}, **LEAN)
    drain = {"HOPLINE_DRAIN_DELAY_S": "60"}
    lone = spawn_replica(mesh, "inference", port, metrics_port, drain, "lone")
    try:
        mesh.start(("tokenizer", "postprocess", "gateway"))
        assert all(predict_all(mesh.gateway, 5))

        start_draining(lone, port)
        before = served_ok(metrics_port, "Infer")
        labels = predict_all(mesh.gateway, 10)
        assert all(labels)
        assert served_ok(metrics_port, "Infer") > before
        assert lone.poll() is None, "the replica stopped accepting before the test ended"
    finally:
        mesh.stop()
        lone.kill()
        lone.wait()


def _watch_all(channel: grpc.Channel, count: int) -> list[grpc.StatusCode]:
    """`count` health watches held open on `channel` (until it closes): how each began."""
    stub = health_pb2_grpc.HealthStub(channel)
    asked = health_pb2.HealthCheckRequest()
    codes = []
    for watch in [stub.Watch(asked, timeout=120) for _ in range(count)]:
        try:
            next(watch)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
    return codes


def test_a_flood_of_health_watches_fails_no_gateways_watch(
    default_repo: Path, tmp_path: Path
) -> None:
    """Health answers any caller, and every gateway's channel keeps a watch on each upstream
    (gRPC's client-side health checking): a refused watch takes the upstream for down. This
    stop's bounds on open watches, first 1,000 a process shared by every caller, then 64 from
    one address, let anyone who filled them (on the health port, or from the gateway's own
    address: a plaintext mesh's loopback) fail the watch of every gateway that connected
    meanwhile, which then answered every miss UNAVAILABLE (an operator's and a reviewer's
    probes). A service's own port bounds no watch now; its health port, where no gateway
    watches, bounds them per client. Here 1,100 watches are held on each port of the
    tokenizer from the address a new gateway then dials from: it is served."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    probe_port = free_port()
    mesh = Mesh(repo, tmp_path, service_env={"tokenizer": {"HOPLINE_HEALTH_PORT": str(probe_port)}})
    late: subprocess.Popen[bytes] | None = None
    try:
        mesh.start(("tokenizer", "inference", "postprocess", "gateway"))
        with (
            grpc.insecure_channel(mesh.addrs["tokenizer"]) as own,
            grpc.insecure_channel(f"127.0.0.1:{probe_port}") as probes,
        ):
            on_port, on_probe_port = _watch_all(own, 1100), _watch_all(probes, 1100)
            assert set(on_port) == {grpc.StatusCode.OK}
            assert on_probe_port.count(grpc.StatusCode.OK) == MAX_INFRA_STREAMS
            refused = on_probe_port.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert refused == 1100 - MAX_INFRA_STREAMS
            port, metrics = free_port(), free_port()
            late = spawn_replica(mesh, "gateway", port, metrics, {}, "late")
            labels = predict_all(f"127.0.0.1:{port}", 5)  # every watch still held
            assert all(labels)
    finally:
        if late is not None:
            late.terminate()
            late.wait(timeout=30)
        mesh.stop()
