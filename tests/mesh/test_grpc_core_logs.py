"""A service's log stays one JSON object a line when gRPC core has something to say.

Unset, GRPC_VERBOSITY let gRPC core write INFO lines to stderr in its own format: a replica
paused long enough for a client's keepalive to give up on it logged, once it ran again,
"I1206 ... chttp2_transport.cc:1403] ipv4:...: Got goaway [11] ... ping_timeout" among its
JSON lines (a helper's probe of paused replicas; a log shipper parsing JSON drops or
misreads such lines). hopline sets GRPC_VERBOSITY=NONE unless the operator set it
(runtime/grpc_io.py:quiet). The service here is a real postprocess process; the client is
this test, pinging every second with a 1 s timeout, so that its keepalive gives up on the
paused service and sends the GOAWAY the service reads when it runs again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import Mesh, free_port, spawn_replica

PAUSE_S = 4.0  # past the client's ping interval and its timeout


def test_a_paused_service_logs_only_json_when_it_runs_again(
    default_repo: Path, tmp_path: Path
) -> None:
    mesh = Mesh(default_repo, tmp_path)
    mesh.env.pop("GRPC_VERBOSITY", None)  # what the service sets itself, not this process
    port = free_port()
    proc = spawn_replica(mesh, "postprocess", port, 0, {"HOPLINE_LOG_FORMAT": "json"}, "paused")
    options = [
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 1000),
        ("grpc.http2.ping_timeout_ms", 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(PAUSE_S)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(1.5)  # it reads what the client sent while it was paused
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)
    lines = (tmp_path / "postprocess-paused.log").read_text().splitlines()
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert lines, "the service logged nothing: nothing shown"
    assert not_json == []
