"""Jaeger remote sampling end to end: a real Jaeger v2 serving strategies from its file, a
co-located mesh sampling by them (OTEL_TRACES_SAMPLER=parentbased_jaeger_remote), and the
share of traces kept changed three times while the mesh runs, with no restart."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh, fetch_trace, serve_refused
from hopline.gateway.client import predict
from hopline.observability.jaeger import JaegerError, LocalJaeger, get_json
from hopline.observability.remote_sampling import Rule, Strategy, parse_strategy, sampling_in_force
from hopline.observability.tracing import EXPORT_SAMPLE_RATIO
from hopline.runtime.service_table import Topology

PREDICT = "hopline.gateway.v1.GatewayService/Predict"
STRATEGIES = Path(__file__).resolve().parents[2] / "deploy/observability/sampling-strategies.json"


def gateway_strategy(share: float, predict_share: float | None = None) -> dict[str, Any]:
    """Jaeger's strategies file: the gateway keeps `share` of traces (Predict its own share,
    where given); every other service keeps none (they follow the gateway's decision)."""
    gateway: dict[str, Any] = {"service": "gateway", "type": "probabilistic", "param": share}
    if predict_share is not None:
        gateway["operation_strategies"] = [
            {"operation": PREDICT, "type": "probabilistic", "param": predict_share}
        ]
    return {
        "default_strategy": {"type": "probabilistic", "param": 0.0},
        "service_strategies": [gateway],
    }


def wait_until_sampling(mesh: Mesh, want: dict[tuple[str, str], float]) -> None:
    """Until the gateway's /metrics says it samples by `want` (Jaeger reloads its file each
    second, the gateway polls every 200 ms)."""
    deadline = time.monotonic() + 30
    seen: dict[tuple[str, str], float] = {}
    while time.monotonic() < deadline:
        seen = sampling_in_force(mesh.metrics_ports["gateway"])
        if seen == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"the gateway samples by {seen}, not {want}")


def trace_ids(mesh: Mesh, tag: str, n: int) -> list[str]:
    return [
        predict(f"sampling {tag} {i}", gateway=mesh.gateway, cache_mode="bypass").trace_id
        for i in range(n)
    ]


def in_jaeger(query: str, trace_id: str) -> bool:
    try:
        get_json(f"{query}/api/v3/traces/{trace_id}")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return False
        raise
    return True


def test_the_share_of_traces_kept_follows_jaeger_while_the_mesh_runs(
    default_repo: Path, tmp_path: Path
) -> None:
    try:
        jaeger = LocalJaeger(tmp_path / "jaeger_work")
    except JaegerError as exc:
        pytest.fail(f"{exc} (`make test` builds it)")
    (tmp_path / "jaeger_work").mkdir()
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    # Predict kept, everything else not: the mesh's first strategy comes from Jaeger.
    jaeger.serve_strategies(gateway_strategy(0.0, predict_share=1.0))
    with jaeger:
        mesh = Mesh(
            repo,
            tmp_path,
            addrs=Topology.COLOCATED.addrs(),
            OTEL_EXPORTER_OTLP_ENDPOINT=jaeger.otlp,
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_TRACES_SAMPLER="parentbased_jaeger_remote",
            OTEL_TRACES_SAMPLER_ARG=(
                f"endpoint={jaeger.sampling},pollingIntervalMs=200,initialSamplingRate=0"
            ),
        )
        try:
            mesh.start()
            wait_until_sampling(mesh, {("", "share"): 0.0, (PREDICT, "share"): 1.0})
            for trace_id in trace_ids(mesh, "kept", 3):
                spans = fetch_trace(jaeger.query, trace_id, want_services=1)
                # The root says why it was kept; the in-process hops are in the trace too.
                root = next(s for s in spans if not s.parent_id)
                assert root.name == PREDICT
                assert root.attributes.get("sampler.type") == "probabilistic"
                assert root.attributes.get("sampler.param") == 1.0
                assert any(s.name.endswith("InferenceService/Infer") for s in spans)

            jaeger.serve_strategies(gateway_strategy(0.0))
            wait_until_sampling(mesh, {("", "share"): 0.0})
            dropped = trace_ids(mesh, "dropped", 3)

            jaeger.serve_strategies(gateway_strategy(1.0))
            wait_until_sampling(mesh, {("", "share"): 1.0})
            (marker,) = trace_ids(mesh, "marker", 1)
            # Each process exports its spans in the order they end: once the marker's trace
            # is in Jaeger, the dropped requests' spans would be there had any been kept.
            fetch_trace(jaeger.query, marker, want_services=1)
            time.sleep(0.5)
            assert [t for t in dropped if in_jaeger(jaeger.query, t)] == []
            assert all(len(t) == 32 for t in dropped)  # sampled out, the reply has its trace id
        finally:
            mesh.stop()


def test_the_shipped_strategies_file_is_what_jaeger_serves(tmp_path: Path) -> None:
    """`make jaeger` serves deploy/observability/sampling-strategies.json: hopline's 10%."""
    shipped = json.loads(STRATEGIES.read_text())
    jaeger = LocalJaeger(tmp_path)
    jaeger.serve_strategies(shipped)
    with jaeger:
        served = parse_strategy(jaeger.strategy("gateway"))
        assert served == Strategy(Rule(EXPORT_SAMPLE_RATIO), {PREDICT: Rule(EXPORT_SAMPLE_RATIO)})
        assert parse_strategy(jaeger.strategy("cache")) == Strategy(Rule(EXPORT_SAMPLE_RATIO))


def test_a_sampler_setting_that_cannot_work_stops_the_service_with_its_reason() -> None:
    env = {
        **os.environ,
        "OTEL_TRACES_SAMPLER": "parentbased_jaeger_remote",
        "OTEL_TRACES_SAMPLER_ARG": "endpoint=jaeger:5778",
        "HOPLINE_LOG_FORMAT": "text",
        "HOPLINE_METRICS_PORT": "0",
    }
    said = serve_refused("postprocess", env)
    assert "cannot set up tracing" in said
    assert "endpoint 'jaeger:5778' is not an http URL" in said
    assert "Traceback" not in said
