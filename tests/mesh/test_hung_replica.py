"""One of two replicas of a stage hangs (SIGSTOP: its connection stays up, it answers
nothing and fails nothing): the stage's calls it holds are hedged to the other replica
(gateway/hedging.py), so misses keep being answered within their deadline. Before, each call
round_robin gave the hung replica waited until gRPC's keepalive dropped the connection (up
to 15 s), and every miss queued behind it on the stage's one slot waited too; with a 5 s
deadline those requests failed DEADLINE_EXCEEDED."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import beside_second_replica, served_ok
from hopline.gateway import hedging
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

TIMEOUT_S = 5.0  # far below the 15 s a hung connection is kept
REQUESTS = 20


@pytest.fixture
def repo(default_repo: Path, tmp_path: Path) -> Path:
    models = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, models / DEFAULT_MODEL)
    return models


def predict(stub: gateway_pb2_grpc.GatewayServiceStub, text: str) -> gateway_pb2.PredictResponse:
    request = gateway_pb2.PredictRequest(text=text, cache_mode=common_pb2.CACHE_MODE_BYPASS)
    reply: gateway_pb2.PredictResponse = stub.Predict(request, timeout=TIMEOUT_S)
    return reply


def hedges_answered(metrics_port: int, hop: str = "tokenize") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hopline_gateway_hedges_total{")
        and f'hop="{hop}"' in line
        and 'result="answered"' in line
    )


def test_a_hung_tokenizer_replica_does_not_hold_misses(repo: Path, tmp_path: Path) -> None:
    with (
        beside_second_replica(repo, tmp_path, "tokenizer", {}, "hung", {}) as (mesh, second),
        grpc.insecure_channel(mesh.gateway) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        # The stage's p99 (and so its hedging delay) comes from its answered calls.
        for _ in range(2 * hedging.MIN_SAMPLES):
            predict(stub, f"where is my order {uuid.uuid4()}")
        assert served_ok(second.metrics_port, "Tokenize") > 0, "the second replica got nothing"
        os.kill(second.proc.pid, signal.SIGSTOP)
        try:
            failures = {}
            for i in range(REQUESTS):
                try:
                    predict(stub, f"what is my balance {uuid.uuid4()}")
                except grpc.RpcError as err:
                    failures[i] = f"{err.code().name}: {err.details()}"
            answered_by_hedges = hedges_answered(mesh.metrics_ports["gateway"])
        finally:
            os.kill(second.proc.pid, signal.SIGCONT)
    assert failures == {}, f"{len(failures)} of {REQUESTS} failed: {failures}"
    assert answered_by_hedges >= REQUESTS // 4, "few calls met the hung replica: proves nothing"


CALLERS = 7
# Each caller's texts in their own length bucket (16, 32, 64, 128 tokens...), so the stage
# has as many Infer calls on their way as callers (one per bucket), as mixed traffic has:
# texts of one length go one batch at a time, which round_robin alternates as one caller's.
WORDS = (1, 3, 7, 14, 28, 50, 2)


def test_a_hung_replica_does_not_hold_several_callers(repo: Path, tmp_path: Path) -> None:
    """Seven callers at once, one of two inference replicas hung: their stage calls'
    hedges, on round_robin's next pick with the other callers' picks between, reached the
    hung replica again about half the time, and every caller waited 5 s for the connection
    to drop in two runs of four (a helper's probe). Hedges now go to a named replica
    (Upstream.replica_stubs)."""
    with (
        beside_second_replica(repo, tmp_path, "inference", {}, "hung", {}) as (mesh, second),
        grpc.insecure_channel(mesh.gateway) as channel,
        concurrent.futures.ThreadPoolExecutor(CALLERS) as pool,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for _ in range(2 * hedging.MIN_SAMPLES):
            predict(stub, f"where is my order {uuid.uuid4()}")
        os.kill(second.proc.pid, signal.SIGSTOP)

        def caller(n: int) -> dict[str, str]:
            failures = {}
            for i in range(REQUESTS // 2):
                try:
                    predict(stub, f"{uuid.uuid4()} " + "what is my balance " * WORDS[n])
                except grpc.RpcError as err:
                    failures[f"{n}/{i}"] = f"{err.code().name}: {err.details()}"
            return failures

        try:
            results = list(pool.map(caller, range(CALLERS)))
            answered_by_hedges = hedges_answered(mesh.metrics_ports["gateway"], "inference")
        finally:
            os.kill(second.proc.pid, signal.SIGCONT)
    failures = {k: v for result in results for k, v in result.items()}
    assert failures == {}, f"{len(failures)} of {CALLERS * REQUESTS // 2} failed: {failures}"
    assert answered_by_hedges >= REQUESTS // 4, "few calls met the hung replica: proves nothing"
