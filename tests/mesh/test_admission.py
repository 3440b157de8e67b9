"""Admission control through real processes: the gateway refuses at once what it cannot
serve (past its in-flight limit, or with too little deadline left for a model answer) and
stops waiting on a cache that cannot keep up.

Slowness is made with HOPLINE_TEST_DELAY_MS (a test-only delay on every RPC of one service),
so the load that would take a big machine to saturate fits in a few requests.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families as parse_text
from triton_calls import rejection, strings, text_input

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.gateway.admission import MIN_PROBE_EVERY
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

SKIPPED = common_pb2.CACHE_OUTCOME_SKIPPED
BYPASS = common_pb2.CACHE_MODE_BYPASS


def new_mesh(default_repo: Path, work: Path, **service_env: dict[str, str]) -> Mesh:
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    # These tests are about lookups: every miss sends one (no key mirror vouching for it).
    gateway = {"HOPLINE_GATEWAY_KEY_MIRROR": "0", **service_env.pop("gateway", {})}
    return Mesh(repo, work, service_env={**service_env, "gateway": gateway}).start()


def metric(mesh: Mesh, service: str, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{mesh.metrics_ports[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in parse_text(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def infer_calls(mesh: Mesh) -> float:
    """Infer RPCs the inference service has served, whatever their status."""
    return metric(mesh, "inference", "hopline_rpc_duration_seconds_count", method="Infer")


def ask(
    mesh: Mesh, text: str, timeout_s: float = 60.0, mode: int = common_pb2.CACHE_MODE_USE
) -> gateway_pb2.PredictResponse | grpc.RpcError:
    with grpc.insecure_channel(mesh.gateway) as channel:
        try:
            reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(
                channel
            ).Predict(gateway_pb2.PredictRequest(text=text, cache_mode=mode), timeout=timeout_s)  # type: ignore[arg-type]
            return reply
        except grpc.RpcError as err:
            return err


@pytest.fixture(scope="module")
def slow_model(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Every Infer takes 400 ms more; the gateway works on at most 2 requests at once."""
    mesh = new_mesh(
        default_repo,
        tmp_path_factory.mktemp("admission"),
        inference={"HOPLINE_TEST_DELAY_MS": "400"},
        gateway={"HOPLINE_GATEWAY_MAX_IN_FLIGHT": "2"},
    )
    try:
        yield mesh
    finally:
        mesh.stop()


def test_past_the_in_flight_limit_requests_are_refused_at_once_not_queued(
    slow_model: Mesh,
) -> None:
    before = infer_calls(slow_model)
    refused_before = metric(slow_model, "gateway", "hopline_gateway_refused_total")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask(slow_model, f"where is parcel {i}?"), range(8)))
    ok = [a for a in answers if isinstance(a, gateway_pb2.PredictResponse)]
    refused = [a for a in answers if isinstance(a, grpc.RpcError)]
    assert ok, "no request got through"
    assert refused, "8 requests at once against a limit of 2: some must be refused"
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "HOPLINE_GATEWAY_MAX_IN_FLIGHT" in (err.details() or "")
    # A refused request never reached the model (no more Infer RPCs than answers: the
    # gateway may batch concurrent misses into one), and the refusals were counted.
    assert 1 <= infer_calls(slow_model) - before <= len(ok)
    refused_now = metric(slow_model, "gateway", "hopline_gateway_refused_total", reason="in_flight")
    assert refused_now - refused_before == len(refused)
    # The places are given back: the next request is served.
    assert isinstance(ask(slow_model, "reset my password please"), gateway_pb2.PredictResponse)


def test_a_deadline_shorter_than_any_model_answer_is_refused_before_the_model_runs(
    slow_model: Mesh,
) -> None:
    for i in range(8):  # the gateway learns how long a model answer takes (>= 400 ms here)
        answer = ask(slow_model, f"cancel my order number {i}", mode=BYPASS)
        assert isinstance(answer, gateway_pb2.PredictResponse), answer
    before = infer_calls(slow_model)
    short = ask(slow_model, "cancel my order number 99", timeout_s=0.2, mode=BYPASS)
    assert isinstance(short, grpc.RpcError)
    assert short.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "longer deadline" in (short.details() or "")
    assert infer_calls(slow_model) == before  # no model run wasted on it
    assert metric(slow_model, "gateway", "hopline_gateway_refused_total", reason="deadline") >= 1
    # One would-be refusal in MIN_PROBE_EVERY goes to the model all the same, so that a path
    # that has become faster is measured (here it has not: the probe runs out of time).
    for i in range(MIN_PROBE_EVERY - 2):
        refused = ask(slow_model, f"cancel my order number {100 + i}", timeout_s=0.2, mode=BYPASS)
        assert isinstance(refused, grpc.RpcError), refused
        assert "longer deadline" in (refused.details() or "")
    assert infer_calls(slow_model) == before
    probe = ask(slow_model, "cancel my order number 199", timeout_s=0.2, mode=BYPASS)
    assert isinstance(probe, grpc.RpcError)
    assert probe.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "longer deadline" not in (probe.details() or "")
    ends = time.monotonic() + 10  # the Infer RPC is counted when it ends, after the deadline
    while infer_calls(slow_model) == before and time.monotonic() < ends:
        time.sleep(0.05)
    assert infer_calls(slow_model) == before + 1
    # A deadline that covers the work is served.
    assert isinstance(
        ask(slow_model, "cancel my order number 99", timeout_s=30), gateway_pb2.PredictResponse
    )


def test_lookups_are_skipped_while_the_cache_cannot_keep_up_and_the_reply_says_so(
    default_repo: Path, tmp_path: Path
) -> None:
    """Every lookup takes 150 ms against a 40 ms budget. The breaker is set out of reach so
    that what is seen is the adaptive skip, not the circuit opening."""
    mesh = new_mesh(
        default_repo,
        tmp_path,
        cache={"HOPLINE_TEST_DELAY_MS": "150"},
        gateway={"HOPLINE_CACHE_BREAKER_FAILURES": "100000", "HOPLINE_CACHE_BUDGET_MS": "40"},
    )
    try:
        answers = [ask(mesh, f"my card was declined at shop {i}") for i in range(40)]
        replies = [a for a in answers if isinstance(a, gateway_pb2.PredictResponse)]
        assert len(replies) == 40, [a for a in answers if isinstance(a, grpc.RpcError)]
        skipped = [r for r in replies if r.cache.outcome == SKIPPED]
        # Only after enough overruns to judge, then most lookups skip the cache.
        assert all(r.cache.outcome != SKIPPED for r in replies[:8])
        assert len(skipped) >= 16, [r.cache.outcome for r in replies]
        assert all("overran" in r.cache.detail for r in skipped)
        assert all("cache_lookup" not in {t.hop for t in r.timings} for r in skipped)
        counted = metric(
            mesh, "gateway", "hopline_cache_lookups_skipped_total", reason="overloaded"
        )
        assert counted == len(skipped)
    finally:
        mesh.stop()


def test_a_kserve_batch_over_the_in_flight_limit_is_refused_as_invalid_not_to_be_retried(
    slow_model: Mesh,
) -> None:
    """Each text of a ModelInfer takes one place in flight: a batch of more texts than the
    limit could never be admitted, so it is a client's mistake to correct (INVALID_ARGUMENT
    naming the setting, and ModelConfig's max_texts_per_request says the limit), not a
    RESOURCE_EXHAUSTED that a client retries for ever."""
    client = triton.InferenceServerClient(url=slow_model.gateway)
    try:
        config = client.get_model_config(DEFAULT_MODEL, as_json=True)["config"]
        assert config["parameters"]["max_texts_per_request"]["string_value"] == "2"
        texts = ["where is parcel 51?", "reset my password", "cancel my order"]
        for _ in range(2):  # the same answer however often it is sent
            status, message = rejection(
                client.infer, DEFAULT_MODEL, [text_input(texts)], client_timeout=30
            )
            assert status == "StatusCode.INVALID_ARGUMENT", message
            assert "batch-size must be <= 2" in message
            assert "HOPLINE_GATEWAY_MAX_IN_FLIGHT" in message
        answered = client.infer(DEFAULT_MODEL, [text_input(texts[:2])], client_timeout=30)
        assert len(strings(answered.as_numpy("label"))) == 2
    finally:
        client.close()


def test_tritons_timeout_parameter_bounds_a_kserve_request(slow_model: Mesh) -> None:
    """tritonclient's infer(timeout=) (microseconds, a request parameter) caps the request's
    time at the gateway as a shorter gRPC deadline does: every Infer here takes 400 ms."""
    client = triton.InferenceServerClient(url=slow_model.gateway)
    try:
        bypass = {"cache_mode": "bypass"}
        texts = [text_input(["where is parcel 61?"])]
        status, message = rejection(
            client.infer,
            DEFAULT_MODEL,
            texts,
            parameters=bypass,
            timeout=100_000,
            client_timeout=30,
        )
        assert status == "StatusCode.DEADLINE_EXCEEDED", message
        answered = client.infer(
            DEFAULT_MODEL, texts, parameters=bypass, timeout=20_000_000, client_timeout=30
        )
        assert strings(answered.as_numpy("cache")) == ["SKIPPED"]
    finally:
        client.close()
