"""Each service's Prometheus endpoint, scraped over HTTP from the real processes."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from harness import Mesh
from hopline.gateway.client import predict
from hopline.observability.metrics import OWNED_BY
from hopline.protos.hopline.common.v1 import common_pb2

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def scrape(mesh: Mesh, service: str, accept: str = "") -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{mesh.metrics_ports[service]}/metrics",
        headers={"Accept": accept} if accept else {},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        body: bytes = reply.read()
        return body.decode()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Values of one sample name (e.g. `..._count`), keyed by their sorted labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in parse_text(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, /, **labels: str) -> float:
    return samples(text, name).get(tuple(sorted(labels.items())), 0.0)


GATEWAY = "hopline.gateway.v1.GatewayService"


def test_every_service_exports_rpc_latency_and_the_gateway_its_cache_outcomes(
    mesh: Mesh,
) -> None:
    before = {name: scrape(mesh, name) for name in mesh.addrs}
    text = "where is my order 4411, it has not arrived"
    first = predict(text, gateway=mesh.gateway, tenant="metrics", timeout_s=30)
    mesh.settle()
    second = predict(text, gateway=mesh.gateway, tenant="metrics", timeout_s=30)
    assert first.cache.outcome == common_pb2.CACHE_OUTCOME_MISS
    assert second.cache.outcome == common_pb2.CACHE_OUTCOME_EXACT
    with pytest.raises(grpc.RpcError):
        predict(" ", gateway=mesh.gateway, timeout_s=30)
    after = {name: scrape(mesh, name) for name in mesh.addrs}

    def grew(process: str, name: str, by: float, **labels: str) -> None:
        delta = value(after[process], name, **labels) - value(before[process], name, **labels)
        assert delta == by, f"{process} {name}{labels}: {delta} != {by}"

    rpc = "hopline_rpc_duration_seconds_count"
    grew("gateway", rpc, 2, service=GATEWAY, method="Predict", code="OK")
    grew("gateway", rpc, 1, service=GATEWAY, method="Predict", code="INVALID_ARGUMENT")
    grew("gateway", "hopline_cache_outcomes_total", 1, model="support-intents", outcome="miss")
    grew("gateway", "hopline_cache_outcomes_total", 1, model="support-intents", outcome="exact")
    grew("gateway", "hopline_hop_duration_seconds_count", 1, hop="inference", code="OK")
    # The miss was vouched for by the key mirror and the repeat answered by the gateway's
    # local exact tier: neither sent a lookup.
    assert first.cache.detail.startswith("not held by the cache")
    assert second.cache.detail == "answered by the gateway's local exact tier"
    grew("gateway", "hopline_known_misses_total", 1)
    grew("gateway", "hopline_hop_duration_seconds_count", 0, hop="cache_lookup", code="OK")
    assert value(after["gateway"], "hopline_local_exact_entries") >= 1
    assert value(after["gateway"], "hopline_key_mirror_keys") >= 1
    grew("inference", "hopline_batch_size_count", 1, component="inference", model="support-intents")
    grew("cache", "hopline_cache_lookups_total", 0, tier="miss")
    svc = "hopline.cache.v1.CacheService"
    grew("cache", rpc, 1, service=svc, method="StoreBatch", code="OK")
    svc = "hopline.inference.v1.InferenceService"
    grew("inference", rpc, 1, service=svc, method="Infer", code="OK")
    svc = "hopline.postprocess.v1.PostprocessService"
    grew("postprocess", rpc, 1, service=svc, method="Postprocess", code="OK")
    # Health probes (the mesh polls them) are neither traced nor counted.
    for service, body in after.items():
        methods = {dict(k)["method"] for k in samples(body, rpc)}
        assert "Check" not in methods, service
        assert value(body, "hopline_rpc_in_flight", service=GATEWAY, method="Predict") == 0


def test_without_an_exporter_no_exemplar_points_at_a_trace_nobody_keeps(mesh: Mesh) -> None:
    """Nothing is recorded when nothing exports, so a latency exemplar would name a trace
    that exists nowhere; the reply still has its trace id. With an exporter the exemplar
    carries it: tests/mesh/test_tracing_jaeger.py."""
    reply = predict("metrics test: exemplar 9182", gateway=mesh.gateway, timeout_s=30)
    assert len(reply.trace_id) == 32
    body = scrape(mesh, "gateway", OPENMETRICS)
    durations = [
        s
        for family in parse_openmetrics(body)  # type: ignore[no-untyped-call]  # untyped upstream
        if family.name == "hopline_rpc_duration_seconds"
        for s in family.samples
        if s.labels.get("method") == "Predict"
    ]
    assert durations  # the histogram is there, in the format that can carry exemplars
    assert not [s for s in durations if s.exemplar is not None]
    assert "trace_id" not in scrape(mesh, "gateway")


def test_each_endpoint_leaves_out_the_families_of_services_its_process_does_not_run(
    mesh: Mesh,
) -> None:
    """A family without labels is exposed at 0 by every process that imports the metrics
    module: a tokenizer's /metrics said `hopline_gateway_in_flight 0` for ever, and every
    process had the cache's `hopline_cache_search_rows`. Each endpoint now shows the families
    of the services its process runs (observability/metrics.py:OWNED_BY)."""
    for name in mesh.addrs:
        families = {f.name for f in parse_text(scrape(mesh, name))}
        owned = {family for family, owner in OWNED_BY.items() if owner == name}
        others = set(OWNED_BY) - owned
        assert owned <= families, f"{name} lacks {sorted(owned - families)}"
        assert not others & families, f"{name} shows {sorted(others & families)}"
