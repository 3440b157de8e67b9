"""A replica added behind a DNS name the gateway already dials gets calls, with no failed
request on the way (runtime/server.py:server_options, HOPLINE_MAX_CONNECTION_AGE_S).

On Kubernetes the gateway dials each service's headless Service (`dns:///inference:8013`)
and round-robins over the pods the name resolves to. A gRPC client resolves the name again
only when one of its connections ends, so a pod added later (a HorizontalPodAutoscaler's
scale-out, a rollout's surge pod) would get no calls from a gateway whose connections stay
up. Every service therefore asks its clients to reconnect once a connection is
HOPLINE_MAX_CONNECTION_AGE_S old, and the reconnect resolves the name again.

Kubernetes' DNS is played by tests/dns_server.py: the name `inference.hopline.test` first
resolves to one inference replica on 127.0.0.2, then to it and a second one on 127.0.0.3
(both loopback, same port, like two pods). gRPC resolves a name at most once per 30 s
(its default), so the second replica is found within about that.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import grpc
from dns_server import DnsServer

from conftest import DEFAULT_MODEL
from harness import Mesh, free_port, served_ok, spawn_replica
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

NAME = "inference.hopline.test"
FIRST, SECOND = "127.0.0.2", "127.0.0.3"
AGE_S = 2  # connections reconnect (and resolve again) about this often
FOUND_WITHIN_S = 75  # gRPC's 30 s between resolutions, the age, a loaded CI machine
LEAN = {"HOPLINE_INFERENCE_THREADS": "1", "HOPLINE_MAX_CONNECTION_AGE_S": str(AGE_S)}


def predict(stub: gateway_pb2_grpc.GatewayServiceStub, count: int) -> None:
    """`count` Predicts that each reach inference (new texts, cache bypassed); any failure
    raises."""
    for _ in range(count):
        reply = stub.Predict(
            gateway_pb2.PredictRequest(
                text=f"where is my order {uuid.uuid4()}", cache_mode=common_pb2.CACHE_MODE_BYPASS
            ),
            timeout=10,
        )
        assert reply.prediction.label


def test_a_replica_added_behind_the_name_gets_calls(default_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    port, second_metrics = free_port(), free_port()
    with DnsServer({NAME: [FIRST]}) as dns:
        mesh = Mesh(
            repo,
            tmp_path,
            addrs={"inference": f"{FIRST}:{port}"},
            service_env={"gateway": {"HOPLINE_INFERENCE_ADDR": dns.authority(NAME, port)}},
            **LEAN,
        )
        second = None
        try:
            mesh.start(("tokenizer", "inference", "postprocess", "gateway"))
            first_metrics = mesh.metrics_ports["inference"]
            with grpc.insecure_channel(mesh.gateway) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                predict(stub, 10)
                assert served_ok(first_metrics, "Infer") >= 10

                second = spawn_replica(mesh, "inference", port, second_metrics, {}, "2", SECOND)
                dns.set(NAME, [FIRST, SECOND])
                asked = len(dns.queries)
                deadline = time.monotonic() + FOUND_WITHIN_S
                sent = 0
                while served_ok(second_metrics, "Infer") == 0:
                    assert time.monotonic() < deadline, (
                        f"the replica added behind {NAME} got none of {sent} calls in "
                        f"{FOUND_WITHIN_S} s; the name was resolved {len(dns.queries) - asked} "
                        "more times"
                    )
                    predict(stub, 5)  # every one must succeed while connections move
                    sent += 5
                # Both replicas now share the calls: round_robin over the two addresses.
                before = served_ok(first_metrics, "Infer"), served_ok(second_metrics, "Infer")
                predict(stub, 40)
                after = served_ok(first_metrics, "Infer"), served_ok(second_metrics, "Infer")
            assert after[0] - before[0] >= 10, (before, after)
            assert after[1] - before[1] >= 10, (before, after)
        finally:
            if second is not None:
                second.terminate()
                second.wait(timeout=30)
            mesh.stop()
