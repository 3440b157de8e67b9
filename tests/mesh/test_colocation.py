"""Placement by address: with every upstream at `inproc` (`hopline run --topology one-process`)
the gateway is the whole mesh, in one process, and answers, caches, invalidates and reports
its hops as the five processes do."""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.service_table import INPROC, ServiceName, Topology


@pytest.fixture(scope="module")
def one_process(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("one-process")
    shutil.copytree(default_repo / DEFAULT_MODEL, work / "models" / DEFAULT_MODEL)
    addrs = Topology.ONE_PROCESS.addrs()
    assert addrs == {name: INPROC for name in ServiceName if name != ServiceName.GATEWAY}
    mesh = Mesh(work / "models", work, addrs=addrs)
    try:
        yield mesh.start()
    finally:
        mesh.stop()


def _predict(mesh: Mesh, text: str) -> gateway_pb2.PredictResponse:
    with grpc.insecure_channel(mesh.gateway) as channel:
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text=text), timeout=30
        )
    return reply


def test_the_gateway_alone_runs_every_stage_and_its_cache(one_process: Mesh) -> None:
    assert set(one_process.procs) == {ServiceName.GATEWAY}  # no process for inproc services
    first = _predict(one_process, "I forgot my password")
    assert first.prediction.label == "password_reset"
    assert first.cache.outcome == common_pb2.CACHE_OUTCOME_MISS
    assert {"tokenize", "inference", "postprocess"} <= {t.hop for t in first.timings}
    # The key mirror is fed over the in-process stream too: a known miss sends no lookup.
    assert first.cache.detail.startswith("not held by the cache")
    one_process.settle()
    # The local exact tier is live over the in-process WatchInvalidations stream.
    assert one_process.gateway_counters()["local_exact_live"] == 1
    again = _predict(one_process, "I forgot my password")
    assert again.cache.outcome == common_pb2.CACHE_OUTCOME_EXACT
    assert again.prediction.label == "password_reset"


def test_co_located_services_are_served_through_their_server_wrappers(one_process: Mesh) -> None:
    """Each in-process call passed the service's server-side wrappers: its RPC metrics are on
    the gateway's /metrics, by the service's own method name."""
    _predict(one_process, "where is my parcel")
    one_process.settle()  # the miss's StoreBatch reached the cache
    url = f"http://127.0.0.1:{one_process.metrics_ports['gateway']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    counted = [
        line for line in text.splitlines() if line.startswith("hopline_rpc_duration_seconds_count")
    ]
    for service, method in (
        ("hopline.tokenizer.v1.TokenizerService", "Tokenize"),
        ("hopline.cache.v1.CacheService", "StoreBatch"),
        ("hopline.inference.v1.InferenceService", "Infer"),
        ("hopline.postprocess.v1.PostprocessService", "Postprocess"),
    ):
        assert any(service in line and f'"{method}"' in line for line in counted), (
            service,
            counted,
        )
