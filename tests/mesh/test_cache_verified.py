"""Verified semantic hits against the real cache service (cache/verify.py) on milvus-lite, or a
Milvus server by URI in `make milvus-server-tests`:
a scope whose candidates the model keeps contradicting stops being served, the evidence
survives a restart of the cache, the counters and metrics say what happened, and a gateway
serving a model with a verify_target reports the model's answers after its replies."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

STORED = "how do i reset my online banking password"
PARAPHRASE = "how can i reset the password of my online banking"
TARGET = 0.01


def scope(tenant: str) -> common_pb2.Scope:
    return common_pb2.Scope(tenant=tenant, model="support-intents", model_version="1")


def store(stub: cache_pb2_grpc.CacheServiceStub, tenant: str) -> None:
    stub.Store(
        cache_pb2.StoreRequest(
            scope=scope(tenant),
            text=STORED,
            prediction=common_pb2.Prediction(label="reset_password", score=0.9),
            mode="semantic",
        ),
        timeout=30,
    )


def lookup(
    stub: cache_pb2_grpc.CacheServiceStub, tenant: str, target: float = TARGET
) -> cache_pb2.LookupResponse:
    reply: cache_pb2.LookupResponse = stub.Lookup(
        cache_pb2.LookupRequest(
            scope=scope(tenant),
            text=PARAPHRASE,
            mode="semantic",
            threshold=0.7,
            verify_target=target,
            verify_confidence=0.9,
        ),
        timeout=30,
    )
    return reply


def report(stub: cache_pb2_grpc.CacheServiceStub, verify_id: str, label: str) -> bool:
    reply = stub.ReportVerification(
        cache_pb2.ReportVerificationRequest(
            verify_id=verify_id, prediction=common_pb2.Prediction(label=label, score=0.8)
        ),
        timeout=30,
    )
    return reply.agreed


def settle(mesh: Mesh) -> None:
    deadline = time.monotonic() + 60
    while mesh.cache_stats().pending_writes:
        assert time.monotonic() < deadline, "stores did not land in Milvus"
        time.sleep(0.05)


def scrape(mesh: Mesh, service: str) -> str:
    url = f"http://127.0.0.1:{mesh.metrics_ports[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text: str = reply.read().decode()
    return text


@pytest.fixture(scope="module")
def cache(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("verified")
    mesh = Mesh(default_repo, work, HOPLINE_CACHE_FLUSH_MS="2")
    try:
        yield mesh.start(("cache",))
    finally:
        mesh.stop()


def test_a_scope_the_model_contradicts_stops_being_served_and_stays_so_after_a_restart(
    cache: Mesh,
) -> None:
    with grpc.insecure_channel(cache.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        for tenant in ("seeded", "control"):
            store(stub, tenant)
        settle(cache)
        # Nothing known yet: the static threshold serves it, and asks for the model's answer.
        first = lookup(stub, "seeded")
        assert first.outcome == common_pb2.CACHE_OUTCOME_SEMANTIC
        assert first.verify_id
        assert not report(stub, first.verify_id, "card_lost")  # the model disagrees
        # One disagreement with nothing agreeing: the answer is held back, not served.
        second = lookup(stub, "seeded")
        assert second.outcome == common_pb2.CACHE_OUTCOME_MISS
        assert second.verify_id  # still a candidate: the model's answer is evidence
        assert not report(stub, second.verify_id, "card_lost")
        # Another tenant's scope has its own evidence and is still served.
        control = lookup(stub, "control")
        assert control.outcome == common_pb2.CACHE_OUTCOME_SEMANTIC
        assert report(stub, control.verify_id, "reset_password")
        stats = cache.cache_stats()
        assert stats.verify_candidates >= 3
        assert stats.verified >= 3
        assert stats.disagreements >= 2
        rules = {r.scope.tenant: r for r in stats.verify_rules}
        assert rules["seeded"].disagreements == 2
        assert rules["seeded"].threshold > second.similarity
        assert rules["control"].disagreements == 0
        metrics = scrape(cache, "cache")
        assert 'hopline_cache_verified_total{model="support-intents",result="disagreed"}' in metrics
        assert "hopline_cache_verify_candidates_total" in metrics
        assert 'hopline_cache_verify_threshold{model="support-intents"' in metrics

    # The cache restarts, not the Milvus server it reaches by URI in the server lanes, as an
    # operator restarts a cache pod. Restarting a standalone with it failed the cache's
    # start-up: the restarted server's proxy sent its first query to the killed query node's
    # registration ("node not match[expectedNodeID=1][actualNodeID=2]"), past the cache's 5 s
    # Milvus timeout (HOPLINE_CACHE_MILVUS_TIMEOUT_S).
    assert cache.terminate("cache") == 0
    cache.start(("cache",))
    with grpc.insecure_channel(cache.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        after = lookup(stub, "seeded")
        assert after.outcome == common_pb2.CACHE_OUTCOME_MISS, "the held-back rule was lost"
        assert after.verify_id
        assert lookup(stub, "control").outcome == common_pb2.CACHE_OUTCOME_SEMANTIC
        rules = {r.scope.tenant: r for r in cache.cache_stats().verify_rules}
        assert rules["seeded"].disagreements == 2
        assert rules["seeded"].observations == 2


def test_bad_verification_input_gets_a_clear_status(cache: Mesh) -> None:
    with grpc.insecure_channel(cache.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        with pytest.raises(grpc.RpcError) as made_up:
            report(stub, "0" * 32, "x")
        assert made_up.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not one a cache issued" in (made_up.value.details() or "")
        store(stub, "ids")
        settle(cache)
        issued = lookup(stub, "ids").verify_id
        assert issued  # nothing known of the scope: every served hit is checked
        report(stub, issued, "reset_password")
        with pytest.raises(grpc.RpcError) as again:
            report(stub, issued, "reset_password")
        assert again.value.code() == grpc.StatusCode.NOT_FOUND
        assert "reported already" in (again.value.details() or "")
        with pytest.raises(grpc.RpcError) as target:
            lookup(stub, "control", target=1.5)
        assert target.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "verify_target" in (target.value.details() or "")
        with pytest.raises(grpc.RpcError) as empty:
            stub.ReportVerification(cache_pb2.ReportVerificationRequest(verify_id="x"), timeout=30)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def verified_mesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The default model's files under a second name whose policy is semantic and verified."""
    work = tmp_path_factory.mktemp("verified-mesh")
    repo = work / "models"
    version = repo / "verified-intents" / "1"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", version)
    config = json.loads((version / "config.json").read_text())
    config["name"] = "verified-intents"
    config["cache"].update(
        mode="semantic", threshold=0.8, min_score=0.0, verify_target=TARGET, verify_confidence=0.9
    )
    (version / "config.json").write_text(json.dumps(config))
    mesh = Mesh(
        repo,
        work,
        HOPLINE_DEFAULT_MODEL="verified-intents",
        HOPLINE_CACHE_BUDGET_MS="5000",
        HOPLINE_CACHE_FLUSH_MS="2",
    )
    try:
        yield mesh.start()
    finally:
        mesh.stop()


def test_the_gateway_serves_a_verified_hit_and_reports_the_models_answer_after_it(
    verified_mesh: Mesh,
) -> None:
    with grpc.insecure_channel(verified_mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def predict(text: str) -> gateway_pb2.PredictResponse:
            reply: gateway_pb2.PredictResponse = stub.Predict(
                gateway_pb2.PredictRequest(text=text, tenant="gw"), timeout=60
            )
            return reply

        assert predict(STORED).cache.outcome == common_pb2.CACHE_OUTCOME_MISS
        verified_mesh.settle()
        settle(verified_mesh)
        hit = predict(PARAPHRASE)
        assert hit.cache.outcome == common_pb2.CACHE_OUTCOME_SEMANTIC
        deadline = time.monotonic() + 30
        while (stats := verified_mesh.cache_stats()).verified < 1:
            assert time.monotonic() < deadline, "the gateway never reported the model's answer"
            time.sleep(0.05)
        # No evidence yet, so the served hit was checked after the reply: one inference for
        # the stored text, one for the check.
        assert stats.verified_after_reply == 1
        assert stats.verify_candidates == 1
        assert verified_mesh.gateway_counters()["inferences"] == 2
        rule = next(r for r in stats.verify_rules if r.scope.tenant == "gw")
        assert rule.observations == 1
