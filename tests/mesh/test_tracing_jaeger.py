"""Traces in a real Jaeger v2 (built by `make`): one trace per request, spans from all five
services with the right parents, and `hopline trace report` blaming an injected slow hop."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)

from conftest import DEFAULT_MODEL
from harness import Mesh, fetch_trace
from hopline.gateway.client import predict
from hopline.observability.jaeger import JaegerError, LocalJaeger, get_json
from hopline.observability.report import Span, build_tree, parse_otlp
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

DELAY_MS = 60  # on postprocess, normally the cheapest hop (about 1 ms)


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    try:
        local = LocalJaeger(tmp_path_factory.mktemp("jaeger"))
    except JaegerError as exc:
        pytest.fail(f"{exc} (`make test` builds it)")
    with local:
        yield {"query": local.query, "otlp": local.otlp}


@pytest.fixture(scope="module")
def traced(
    jaeger: dict[str, str], default_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("traced")
    repo = work / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(
        repo,
        work,
        service_env={"postprocess": {"HOPLINE_TEST_DELAY_MS": str(DELAY_MS)}},
        OTEL_EXPORTER_OTLP_ENDPOINT=jaeger["otlp"],
        OTEL_BSP_SCHEDULE_DELAY="100",
        # Every trace (hopline samples 10% by default when exporting), and one RPC per
        # request: this module pins down the per-request tree; batch spans are checked in
        # tests/unit/test_stage_batching.py.
        OTEL_TRACES_SAMPLER="parentbased_always_on",
        HOPLINE_GATEWAY_BATCH_MAX_ROWS="1",
        HOPLINE_CACHE_BUDGET_MS="2000",
        # Every miss sends its lookup, so its trace shows all five services; a miss the key
        # mirror vouches for has no cache hop (tests/mesh/test_key_mirror_mesh.py).
        HOPLINE_GATEWAY_KEY_MIRROR="0",
    )
    try:
        yield mesh.start()
    finally:
        mesh.stop()


def one(spans: list[Span], name: str, service: str) -> Span:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, f"{name}@{service}: {len(found)} spans"
    return found[0]


def check_stream_trace(traced: Mesh, base: str) -> None:
    """One stream is one trace: the stream's server span (ended after its last message, our
    own interceptor's work) over a `gateway.stream_message` span per request, each with
    that request's hops beneath it."""
    ids = ["s0", "s1", "s2"]
    messages = [
        gateway_pb2.PredictStreamRequest(
            id=rid, request=gateway_pb2.PredictRequest(text=f"stream order {rid}", tenant="traces")
        )
        for rid in ids
    ]
    with grpc.insecure_channel(traced.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        replies = list(stub.PredictStream(iter(messages), timeout=30))
    assert sorted(r.id for r in replies) == ids
    assert {r.code for r in replies} == {grpc.StatusCode.OK.value[0]}
    trace_id = replies[0].response.trace_id
    deadline = time.monotonic() + 30
    while True:
        spans = fetch_trace(base, trace_id, want_services=5)
        posts = [s for s in spans if s.name.endswith("PostprocessService/Postprocess")]
        if len(posts) == len(ids):
            break
        assert time.monotonic() < deadline, f"{len(posts)} postprocess spans in {trace_id}"
        time.sleep(0.2)
    root = build_tree(spans)
    assert root is not None
    assert (root.name, root.service) == (
        "hopline.gateway.v1.GatewayService/PredictStream",
        "gateway",
    )
    assert root.attributes["hopline.stream.messages_sent"] == len(ids)
    per_message = [s for s in spans if s.name == "gateway.stream_message"]
    assert sorted(s.attributes["hopline.stream.message_id"] for s in per_message) == ids
    for message in per_message:
        assert message.parent_id == root.span_id
        assert message.end <= root.end
        hops = {s.name: s for s in spans if s.parent_id == message.span_id}
        assert {"tokenize", "cache_lookup", "inference", "postprocess"} <= set(hops), hops
        server = [s for s in spans if s.parent_id == hops["inference"].span_id]
        assert [s.name for s in server] == ["hopline.inference.v1.InferenceService/Infer"]
        assert message.attributes["hopline.cache.outcome"] == "miss"


def test_traces_span_every_hop_with_correct_parents_and_the_report_blames_the_slow_hop(
    traced: Mesh, jaeger: dict[str, str], tmp_path: Path
) -> None:
    replies: list[gateway_pb2.PredictResponse] = []
    texts = [f"where is my order number {n}" for n in range(20)]
    for text in texts:  # misses, each through postprocess and its injected delay
        replies.append(predict(text, gateway=traced.gateway, tenant="traces", timeout_s=30))
    traced.settle()
    for text in texts:  # exact hits: no inference, no postprocess
        replies.append(predict(text, gateway=traced.gateway, tenant="traces", timeout_s=30))
    outcomes = [r.cache.outcome for r in replies]
    assert outcomes[:20] == [common_pb2.CACHE_OUTCOME_MISS] * 20
    assert outcomes[20:] == [common_pb2.CACHE_OUTCOME_EXACT] * 20
    assert len({r.trace_id for r in replies}) == 40  # one trace per request

    base = jaeger["query"]
    miss = fetch_trace(base, replies[0].trace_id, want_services=5)
    assert {s.service for s in miss} == {
        "gateway",
        "tokenizer",
        "cache",
        "inference",
        "postprocess",
    }
    assert {s.trace_id for s in miss} == {replies[0].trace_id}
    root = build_tree(miss)
    assert root is not None
    assert (root.name, root.service, root.parent_id) == (
        "hopline.gateway.v1.GatewayService/Predict",
        "gateway",
        "",
    )
    assert root.attributes["hopline.cache.outcome"] == "miss"
    assert root.attributes["hopline.model"] == DEFAULT_MODEL
    # Each hop: the gateway's client span under the root, the service's server span under it.
    for hop, service, rpc in (
        ("tokenize", "tokenizer", "hopline.tokenizer.v1.TokenizerService/Tokenize"),
        ("cache_lookup", "cache", "hopline.cache.v1.CacheService/Lookup"),
        ("inference", "inference", "hopline.inference.v1.InferenceService/Infer"),
        ("postprocess", "postprocess", "hopline.postprocess.v1.PostprocessService/Postprocess"),
    ):
        client = one(miss, hop, "gateway")
        server = one(miss, rpc, service)
        assert client.parent_id == root.span_id, hop
        assert server.parent_id == client.span_id, hop
        assert client.start <= server.start, hop
        assert server.end <= client.end, hop
    infer = one(miss, "hopline.inference.v1.InferenceService/Infer", "inference")
    assert one(miss, "inference.run", "inference").parent_id == infer.span_id
    # A request that ran at once waited for nothing: no queue span (a zero-length one was
    # flagged by Jaeger in every trace); one that waited has its wait.
    queued = [s for s in miss if s.name == "inference.queue"]
    assert all(s.parent_id == infer.span_id and s.end > s.start for s in queued), queued
    assert one(miss, "inference.run", "inference").attributes["hopline.batch_size"] == 1
    lookup = one(miss, "hopline.cache.v1.CacheService/Lookup", "cache")
    assert one(miss, "cache.exact_read", "cache").parent_id == lookup.span_id
    post = one(miss, "hopline.postprocess.v1.PostprocessService/Postprocess", "postprocess")
    assert post.attributes["hopline.test_delay_ms"] == DELAY_MS
    assert post.ms >= DELAY_MS

    # Once their stores landed the gateway holds the entries itself: exact repeats are
    # answered by its local tier with no hop, so their traces have the gateway's span alone.
    hit = fetch_trace(base, replies[20].trace_id, want_services=1)
    assert {s.service for s in hit} == {"gateway"}
    hit_root = build_tree(hit)
    assert hit_root is not None
    assert hit_root.attributes["hopline.cache.local"] is True
    assert hit_root.attributes["hopline.cache.outcome"] == "exact"
    assert not [s for s in hit if s.name in ("cache_lookup", "inference", "postprocess")]

    # Every request reached Jaeger as exactly one trace rooted at the gateway.
    for reply in replies[1:20] + replies[21:]:
        spans = fetch_trace(base, reply.trace_id, want_services=5 if reply in replies[:20] else 1)
        roots = [s for s in spans if not s.parent_id]
        assert [r.name for r in roots] == ["hopline.gateway.v1.GatewayService/Predict"]

    check_stream_trace(traced, base)

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "trace",
            "report",
            "--jaeger",
            base,
            "--service",
            "gateway",
            "--since",
            "10m",
            "--above",
            "p90",
            "--json",
            str(tmp_path / "report.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["traces"] == 40
    top = next(r for r in report["rows"] if not r["name"].startswith("  "))
    assert top["name"] == "postprocess", out.stdout
    assert top["critical_ms"] >= DELAY_MS


def test_latency_exemplars_carry_the_trace_id_of_an_exported_trace(
    traced: Mesh, jaeger: dict[str, str]
) -> None:
    """From a latency bucket on /metrics to the trace in Jaeger: the newest observation in its
    bucket carries this request's trace id. Plain text (what `curl` gets) has none."""
    reply = predict("metrics test: exemplar 9182", gateway=traced.gateway, timeout_s=30)
    url = f"http://127.0.0.1:{traced.metrics_ports['gateway']}/metrics"
    accept = {"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=accept), timeout=10) as r:
        body = r.read().decode()
    exemplars = {
        s.exemplar.labels["trace_id"]
        for family in parse_openmetrics(body)  # type: ignore[no-untyped-call]  # untyped upstream
        if family.name == "hopline_rpc_duration_seconds"
        for s in family.samples
        if s.exemplar is not None and s.labels.get("method") == "Predict"
    }
    assert reply.trace_id in exemplars
    with urllib.request.urlopen(url, timeout=10) as r:
        assert "trace_id" not in r.read().decode()
    assert {s.trace_id for s in fetch_trace(jaeger["query"], reply.trace_id, 1)} == {reply.trace_id}


def test_the_model_list_read_for_an_unknown_model_is_in_the_requests_trace(
    traced: Mesh, jaeger: dict[str, str]
) -> None:
    """A request naming a model the gateway does not know reads the model list again before
    answering NOT_FOUND: that ListModels is part of its time, so its trace holds it (a client
    span and inference's server span under it); before, it was a root trace of its own."""
    trace_id = "4f1c" + "0" * 27 + "1"
    with grpc.insecure_channel(traced.gateway) as channel, pytest.raises(grpc.RpcError) as info:
        gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text="hello", model="no-such-model"),
            timeout=30,
            metadata=(("traceparent", f"00-{trace_id}-{'1' * 16}-01"),),
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    names = {"list_models", "hopline.inference.v1.InferenceService/ListModels"}
    deadline = time.monotonic() + 30
    while True:  # the caller's span is the parent: no span of the trace is its root
        try:
            doc = get_json(f"{jaeger['query']}/api/v3/traces/{trace_id}")
            spans = parse_otlp([doc]).get(trace_id, [])
        except urllib.error.HTTPError:
            spans = []
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    client = one(spans, "list_models", "gateway")
    server = one(spans, "hopline.inference.v1.InferenceService/ListModels", "inference")
    assert server.parent_id == client.span_id


def test_each_text_of_a_kserve_batch_has_its_own_span(traced: Mesh, jaeger: dict[str, str]) -> None:
    """A ModelInfer's texts ran flat under its server span: which hop was whose could not be
    told, and each text's cache outcome overwrote the others' on that one span."""
    import tritonclient.grpc as triton
    from triton_calls import text_input

    trace_id = "6b3d" + "0" * 27 + "2"
    client = triton.InferenceServerClient(url=traced.gateway)
    try:
        client.infer(
            DEFAULT_MODEL,
            [text_input(["where is parcel 7781?", "cancel order 7781 please"])],
            parameters={"cache_mode": "bypass"},
            headers={"traceparent": f"00-{trace_id}-{'3' * 16}-01"},
            client_timeout=60,
        )
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            doc = get_json(f"{jaeger['query']}/api/v3/traces/{trace_id}")
            spans = parse_otlp([doc]).get(trace_id, [])
        except urllib.error.HTTPError:
            spans = []
        texts = [s for s in spans if s.name == "gateway.infer_text"]
        hops = [s for s in spans if s.name == "postprocess" and s.service == "gateway"]
        if (len(texts) == 2 and len(hops) == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    server = one(spans, "inference.GRPCInferenceService/ModelInfer", "gateway")
    assert sorted(s.attributes["hopline.text_index"] for s in texts) == [0, 1]
    assert {s.parent_id for s in texts} == {server.span_id}
    # Each text's hops under its own span; its cache outcome on it.
    assert sorted(h.parent_id for h in hops) == sorted(s.span_id for s in texts)
    assert all(s.attributes.get("hopline.cache.outcome") == "skipped" for s in texts)


def test_jaeger_exports_nothing_of_its_own_and_stops_without_waiting_on_it(
    tmp_path: Path,
) -> None:
    """Jaeger v2's query extension traces its own API calls unless its config says
    `enable_tracing: false`, and exports them to the OTLP default, 127.0.0.1:4317, where
    nothing of ours listens: it logged each failed connection, and at its stop the export's
    10 s timeout ran out ("traces export: ... timeout") before it exited. A Jaeger asked
    for its services and stopped logs none of that."""
    with LocalJaeger(tmp_path) as local:
        get_json(f"{local.query}/api/services")
    log = local.log_path.read_text(encoding="utf-8")
    assert "4317" not in log, log[-2000:]
    assert "traces export" not in log, log[-2000:]
