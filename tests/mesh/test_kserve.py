"""The gateway's KServe v2 / Open Inference Protocol service, called by the real tritonclient.

Every call goes over real gRPC to a real mesh; answers are checked against the gateway's own
Predict for the same texts, never against numbers written here.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import queue
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from triton_calls import rejection, strings, text_input

# Triton's own generated stubs for the same wire protocol: "raw" stubs, independent of ours.
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import DEFAULT_MODEL
from harness import TOPOLOGIES, Mesh
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.runtime.service_table import Topology

# Every test here passes with the stateless stages in their own processes and in the gateway.
MESH_TOPOLOGIES = TOPOLOGIES

TEXTS = [
    "I forgot my password and can't log in",
    "where is my package? it still hasn't arrived",
    "let me speak to a real human please",
    "what is the boiling point of nitrogen in kelvin",
    "please cancel my subscription",
]
OUTPUT_NAMES = ["label", "score", "scores", "out_of_scope", "cache"]


@pytest.fixture(scope="module")
def omesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The five services over a copy of the default repository."""
    work = tmp_path_factory.mktemp("omesh")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    m = Mesh(
        repo,
        work,
        HOPLINE_CACHE_FLUSH_MS="2",
        HOPLINE_CACHE_BUDGET_MS="2000",  # a slow CI machine must not turn hits into fail-opens
    )
    try:
        yield m.start()
    finally:
        m.stop()


@pytest.fixture(scope="module")
def client(omesh: Mesh) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=omesh.gateway)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def labels(omesh: Mesh) -> list[str]:
    doc: list[str] = json.loads(
        (omesh.repo / DEFAULT_MODEL / "1" / "labels.json").read_text(encoding="utf-8")
    )
    return doc


def predict(
    mesh: Mesh, text: str, top_k: int = 1, tenant: str = "", cache: str = "use"
) -> gateway_pb2.PredictResponse:
    modes = {"use": common_pb2.CACHE_MODE_USE, "bypass": common_pb2.CACHE_MODE_BYPASS}
    with grpc.insecure_channel(mesh.gateway) as channel:
        response: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(
            channel
        ).Predict(
            gateway_pb2.PredictRequest(
                text=text, top_k=top_k, tenant=tenant, cache_mode=modes[cache]
            ),
            timeout=30,
        )
        return response


# -- server and model metadata --------------------------------------------------------------


def test_live_ready_and_server_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() is True
    assert client.is_server_ready() is True
    meta = client.get_server_metadata()
    assert meta.name == "hopline"
    assert meta.version == importlib.metadata.version("hopline")
    assert list(meta.extensions) == ["parameters", "classification", "model_configuration"]


def test_model_ready_by_name_and_version(client: triton.InferenceServerClient) -> None:
    assert client.is_model_ready(DEFAULT_MODEL) is True
    assert client.is_model_ready(DEFAULT_MODEL, "1") is True
    assert client.is_model_ready(DEFAULT_MODEL, "9") is False
    assert client.is_model_ready("no-such-model") is False


def test_model_metadata_describes_inputs_and_outputs(
    client: triton.InferenceServerClient, labels: list[str]
) -> None:
    meta = client.get_model_metadata(DEFAULT_MODEL)
    assert meta.name == DEFAULT_MODEL
    assert list(meta.versions) == ["1"]
    assert meta.platform == "hopline"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("text", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("label", "BYTES", [-1]),
        ("score", "FP32", [-1]),
        ("scores", "FP32", [-1, len(labels)]),
        ("out_of_scope", "BOOL", [-1]),
        ("cache", "BYTES", [-1]),
    ]
    status, message = rejection(client.get_model_metadata, "no-such-model")
    assert status == "StatusCode.NOT_FOUND"
    assert "no-such-model" in message
    assert f"{DEFAULT_MODEL}/1" in message  # says what is served


def test_model_config_says_what_runs_the_version(
    omesh: Mesh, client: triton.InferenceServerClient
) -> None:
    """Triton's ModelConfig extension: the tensors agree with the metadata, and the device,
    accelerators, precision and providers are what the inference service runs the version on
    (on this CPU-only ONNX Runtime: the CPU provider alone)."""
    with grpc.insecure_channel(omesh.addrs["inference"]) as channel:
        listed = inference_pb2_grpc.InferenceServiceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), timeout=10
        )
    (served,) = [m for m in listed.models if m.name == DEFAULT_MODEL]
    config = client.get_model_config(DEFAULT_MODEL, as_json=True)["config"]
    meta = client.get_model_metadata(DEFAULT_MODEL)
    assert config["name"] == DEFAULT_MODEL
    assert config["backend"] == "onnxruntime"
    assert "max_batch_size" not in config  # 0: the dims are whole shapes, as in the metadata
    shapes = [(t["name"], t["data_type"], t["dims"]) for t in config["input"] + config["output"]]
    datatypes = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32", "BOOL": "TYPE_BOOL"}
    assert shapes == [
        (t.name, datatypes[t.datatype], [str(d) for d in t.shape])
        for t in [*meta.inputs, *meta.outputs]
    ]
    gpu = {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(served.providers)
    assert [g["kind"] for g in config["instance_group"]] == ["KIND_GPU" if gpu else "KIND_CPU"]
    assert ("optimization" in config) == bool(gpu)
    parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert parameters == {
        "precision": served.precision,
        "providers": ",".join(served.providers),
        "max_texts_per_request": str(served.max_batch_size),
    }
    assert served.providers[-1] == "CPUExecutionProvider"
    status, message = rejection(client.get_model_config, DEFAULT_MODEL, "9")
    assert status == "StatusCode.NOT_FOUND"
    assert f"{DEFAULT_MODEL}/1" in message  # says what is served


def test_health_and_reflection_list_the_kserve_service(omesh: Mesh) -> None:
    with grpc.insecure_channel(omesh.gateway) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("inference.GRPCInferenceService", "hopline.gateway.v1.GatewayService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"inference.GRPCInferenceService", "hopline.gateway.v1.GatewayService"} <= names


def test_reflection_finds_a_file_by_a_methods_full_name(omesh: Mesh) -> None:
    """What grpcurl's `describe` and ghz's reflection mode ask: grpcio-reflection answered
    NOT_FOUND for every method ("Symbol not found"), protobuf's pool finding no methods."""
    symbols = {
        "hopline.gateway.v1.GatewayService.Predict": "hopline/gateway/v1/gateway.proto",
        "inference.GRPCInferenceService.ModelInfer": "",  # KServe's file: any name, found
        "grpc.health.v1.Health.Check": "grpc_health/v1/health.proto",
        "hopline.gateway.v1.PredictRequest": "hopline/gateway/v1/gateway.proto",
    }
    asked = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in symbols]
    asked.append(
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="hopline.gateway.v1.GatewayService.NoSuchMethod"
        )
    )
    with grpc.insecure_channel(omesh.gateway) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(stub.ServerReflectionInfo(iter(asked), timeout=10))
    for (symbol, file), answer in zip(symbols.items(), answers, strict=False):
        assert answer.HasField("file_descriptor_response"), (symbol, answer.error_response)
        first = descriptor_pb2.FileDescriptorProto.FromString(
            answer.file_descriptor_response.file_descriptor_proto[0]
        )
        assert first.name == file or (not file and first.name), (symbol, first.name)
    assert answers[-1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


# -- inference ------------------------------------------------------------------------------


def test_batch_matches_predict(
    omesh: Mesh, client: triton.InferenceServerClient, labels: list[str]
) -> None:
    result = client.infer(
        DEFAULT_MODEL,
        [text_input(TEXTS)],
        request_id="batch-1",
        parameters={"cache_mode": "bypass"},
        client_timeout=60,
    )
    response = result.get_response()
    assert response.id == "batch-1"
    assert (response.model_name, response.model_version) == (DEFAULT_MODEL, "1")
    assert [o.name for o in response.outputs] == OUTPUT_NAMES
    assert len(response.parameters["trace_id"].string_param) == 32
    assert response.parameters["tenant"].string_param == "default"

    got_labels = strings(result.as_numpy("label"))
    score = result.as_numpy("score")
    scores = result.as_numpy("scores")
    out_of_scope = result.as_numpy("out_of_scope")
    assert score.dtype == np.float32
    assert scores.dtype == np.float32
    assert scores.shape == (len(TEXTS), len(labels))
    assert out_of_scope.dtype == np.bool_
    assert strings(result.as_numpy("cache")) == ["SKIPPED"] * len(TEXTS)
    for i, text in enumerate(TEXTS):
        expected = predict(omesh, text, top_k=len(labels), cache="bypass").prediction
        assert got_labels[i] == expected.label, text
        assert bool(out_of_scope[i]) == expected.out_of_scope, text
        assert score[i] == pytest.approx(expected.score, rel=1e-5), text
        by_label = {s.label: s.score for s in expected.top_k}
        np.testing.assert_allclose(scores[i], [by_label[name] for name in labels], rtol=1e-5)
        # The full softmax row, columns in the model's label order.
        assert scores[i].sum() == pytest.approx(1.0, abs=1e-4)
        assert score[i] == pytest.approx(scores[i].max(), rel=1e-6)
        if not expected.out_of_scope:
            assert got_labels[i] == labels[int(np.argmax(scores[i]))]
    # The texts are not all the same intent: the batch is not one answer repeated.
    assert len(set(got_labels)) >= 4


def test_requested_outputs_only(client: triton.InferenceServerClient) -> None:
    result = client.infer(
        DEFAULT_MODEL,
        [text_input(TEXTS[:2])],
        outputs=[triton.InferRequestedOutput("score"), triton.InferRequestedOutput("label")],
        client_timeout=60,
    )
    assert [o.name for o in result.get_response().outputs] == ["score", "label"]
    assert result.as_numpy("scores") is None
    assert result.as_numpy("score").shape == (2,)
    assert strings(result.as_numpy("label"))[0] == "password_reset"


def test_async_infer_calls_back(client: triton.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer(
        DEFAULT_MODEL,
        [text_input(TEXTS[:3])],
        callback=lambda result, error: answers.put((result, error)),
        outputs=[triton.InferRequestedOutput("label")],
        client_timeout=60,
    )
    result, error = answers.get(timeout=60)
    assert error is None
    sync = client.infer(
        DEFAULT_MODEL,
        [text_input(TEXTS[:3])],
        outputs=[triton.InferRequestedOutput("label")],
        client_timeout=60,
    )
    assert strings(result.as_numpy("label")) == strings(sync.as_numpy("label"))


def test_tenant_parameter_scopes_the_cache(
    omesh: Mesh, client: triton.InferenceServerClient
) -> None:
    text = "my card payment keeps getting declined at checkout"
    outputs = [triton.InferRequestedOutput(n) for n in ("label", "score", "cache")]

    def ask(**kwargs: Any) -> Any:
        return client.infer(
            DEFAULT_MODEL, [text_input([text])], outputs=outputs, client_timeout=60, **kwargs
        )

    first = ask(parameters={"tenant": "acme"})
    assert strings(first.as_numpy("cache")) == ["MISS"]
    assert first.get_response().parameters["tenant"].string_param == "acme"
    omesh.settle()
    again = ask(parameters={"tenant": "acme"})
    assert strings(again.as_numpy("cache")) == ["EXACT"]
    assert strings(again.as_numpy("label")) == strings(first.as_numpy("label"))
    assert again.as_numpy("score")[0] == first.as_numpy("score")[0]
    # Another tenant never sees acme's entry.
    other = ask(parameters={"tenant": "globex"})
    assert strings(other.as_numpy("cache")) == ["MISS"]
    # The gateway's identity rules hold here too: x-hopline-tenant metadata names the tenant.
    by_header = ask(headers={"x-hopline-tenant": "acme"})
    assert strings(by_header.as_numpy("cache")) == ["EXACT"]
    assert by_header.get_response().parameters["tenant"].string_param == "acme"
    # One path, one cache: the gateway's own Predict finds the entry ModelInfer stored.
    assert predict(omesh, text, tenant="acme").cache.outcome == common_pb2.CACHE_OUTCOME_EXACT
    # refresh recomputes instead of reading.
    refreshed = ask(parameters={"tenant": "acme", "cache_mode": "refresh"})
    assert strings(refreshed.as_numpy("cache")) == ["SKIPPED"]


def test_a_batch_within_the_limit_is_not_refused_by_its_own_tenants_share(
    omesh: Mesh, client: triton.InferenceServerClient
) -> None:
    """Each text of a batch takes a place in flight, and beside eight tenants sending a
    tenant's share is 32 places: a 64-text batch, within the advertised
    max_texts_per_request, was refused RESOURCE_EXHAUSTED "this tenant has 32 requests in
    flight" at every try (a Triton client's retries never got through). Its texts now go in
    flight 32 at a time, as a stream's requests do."""
    stop = threading.Event()
    sent = threading.Barrier(9)

    def another_tenant(tenant: str) -> None:
        request = gateway_pb2.PredictRequest(
            text="where is my parcel", tenant=tenant, cache_mode=common_pb2.CACHE_MODE_BYPASS
        )
        with grpc.insecure_channel(omesh.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            stub.Predict(request, timeout=60)
            sent.wait(60)
            while not stop.is_set():  # each counts as sending for a second after a request
                stub.Predict(request, timeout=60)

    others = [threading.Thread(target=another_tenant, args=(f"t{n}",)) for n in range(8)]
    for thread in others:
        thread.start()
    try:
        sent.wait(60)
        salt = uuid.uuid4().hex[:8]
        texts = [f"where is my parcel number {n} {salt}" for n in range(64)]
        result = client.infer(
            DEFAULT_MODEL,
            [text_input(texts)],
            outputs=[triton.InferRequestedOutput("label")],
            parameters={"tenant": "bulk"},
            client_timeout=120,
        )
        assert len(strings(result.as_numpy("label"))) == 64
        # A stream's 64 requests likewise: past 32 in flight they were refused one by one.
        with grpc.insecure_channel(omesh.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            messages = (
                gateway_pb2.PredictStreamRequest(
                    id=str(n), request=gateway_pb2.PredictRequest(text=f"{text} again")
                )
                for n, text in enumerate(texts)
            )
            replies = list(
                stub.PredictStream(messages, timeout=120, metadata=(("x-hopline-tenant", "bulk"),))
            )
        assert [r.message for r in replies if r.code] == []
        assert len(replies) == 64
        # And a ModelStreamInfer stream of 20 batches of 16: counted by requests, its 320
        # texts went in flight at once, past the gateway's own limit of 256.
        streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
        streamer = triton.InferenceServerClient(url=omesh.gateway)
        streamer.start_stream(callback=lambda result, error: streamed.put((result, error)))
        try:
            for n in range(20):
                streamer.async_stream_infer(
                    DEFAULT_MODEL,
                    [text_input([f"{t} batch {n}" for t in texts[:16]])],
                    request_id=f"b{n}",
                    outputs=[triton.InferRequestedOutput("label")],
                    parameters={"tenant": "bulk"},
                    enable_empty_final_response=True,
                )
            got = [streamed.get(timeout=120) for _ in range(20)]
        finally:
            streamer.stop_stream()
            streamer.close()
        assert [str(e.message()) for _, e in got if e is not None] == []
        for result, _ in got:
            assert len(strings(result.as_numpy("label"))) == 16
            # Each response is its request's last: a client asking for the mark waited for ever.
            assert result.get_response().parameters["triton_final_response"].bool_param
    finally:
        stop.set()
        for thread in others:
            thread.join(60)


def test_stream_infer_answers_each_request_and_fails_one_in_band(
    omesh: Mesh, client: triton.InferenceServerClient
) -> None:
    """Triton's ModelStreamInfer (start_stream / async_stream_infer): it was not served, and
    tritonclient's aio client read gRPC's ending of the stream as INTERNAL "Internal error
    from Core" (12 of 15 tries, a Triton-client probe). Each request is answered as
    ModelInfer would, a failing one in `error_message` while the stream goes on."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    label = [triton.InferRequestedOutput("label")]
    try:
        for i, text in enumerate(TEXTS):
            client.async_stream_infer(
                DEFAULT_MODEL, [text_input([text])], request_id=f"s{i}", outputs=label
            )
        client.async_stream_infer("no-such-model", [text_input(["hi"])], request_id="bad")
        client.async_stream_infer(
            DEFAULT_MODEL, [text_input([TEXTS[0]])], request_id="after", outputs=label
        )
        got = [results.get(timeout=60) for _ in range(len(TEXTS) + 2)]
    finally:
        client.stop_stream()
    answered = {r.get_response().id: strings(r.as_numpy("label")) for r, e in got if e is None}
    errors = [str(e.message()) for r, e in got if e is not None]
    assert len(errors) == 1, errors
    assert errors[0].startswith("NOT_FOUND: "), errors
    assert "no-such-model" in errors[0]
    assert set(answered) == {f"s{i}" for i in range(len(TEXTS))} | {"after"}
    for i, text in enumerate(TEXTS):
        assert answered[f"s{i}"] == [predict(omesh, text).prediction.label]
    assert answered["after"] == answered["s0"]


def test_a_lone_tenants_stream_of_batches_stays_within_the_gateways_limit(
    default_repo: Path, tmp_path: Path
) -> None:
    """A ModelStreamInfer stream's requests were counted, not their texts: 20 requests of
    16 texts from a gateway's only tenant put 320 texts in flight against a limit of 64 here,
    and the rest were refused RESOURCE_EXHAUSTED (a reviewer's reproduction). The stream's
    texts take turns within the limit. And a request is read only once its texts fit: each
    request's time runs from its read, and a stream with no deadline that sent its backlog at
    once had most of it fail DEADLINE_EXCEEDED at the gateway's cap, waiting for turns
    behind each other (a client probe: 47 of 80 requests of 64 texts); here 60 requests of
    16 texts under a 2 s cap."""
    alone = Mesh(
        default_repo,
        tmp_path,
        addrs=Topology.COLOCATED.addrs(),
        HOPLINE_GATEWAY_MAX_IN_FLIGHT="64",
        HOPLINE_UPSTREAM_TIMEOUT_S="2",
    )
    alone.start()
    streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
    streamer = triton.InferenceServerClient(url=alone.gateway)
    requests = 60
    try:
        streamer.start_stream(callback=lambda result, error: streamed.put((result, error)))
        for n in range(requests):
            streamer.async_stream_infer(
                DEFAULT_MODEL,
                [text_input([f"where is parcel {n}-{k}" for k in range(16)])],
                request_id=f"b{n}",
                outputs=[triton.InferRequestedOutput("label")],
            )
        got = [streamed.get(timeout=120) for _ in range(requests)]
    finally:
        streamer.stop_stream()
        streamer.close()
        alone.stop()
    assert [str(e.message()) for _, e in got if e is not None] == []
    assert all(len(strings(result.as_numpy("label"))) == 16 for result, _ in got)


def test_aio_stream_infer_answers_many_requests(omesh: Mesh) -> None:
    """tritonclient.grpc.aio's stream_infer with 50 requests on one stream, each answered."""

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i in range(50):
            text = triton_aio.InferInput("text", [1], "BYTES")
            text.set_data_from_numpy(np.array([f"where is parcel {i}".encode()], dtype=np.object_))
            yield {"model_name": DEFAULT_MODEL, "inputs": [text], "request_id": f"r{i}"}

    async def stream() -> list[str]:
        client = triton_aio.InferenceServerClient(url=omesh.gateway)
        ids: list[str] = []
        try:
            async for result, error in client.stream_infer(requests(), stream_timeout=120):
                assert error is None, (error.status(), error.message(), error.debug_details())
                ids.append(result.get_response().id)
                if len(ids) == 50:
                    break
        finally:
            await client.close()
        return ids

    assert sorted(asyncio.run(stream())) == sorted(f"r{i}" for i in range(50))


# -- errors ---------------------------------------------------------------------------------


def test_unknown_model_and_version_are_not_found(client: triton.InferenceServerClient) -> None:
    status, message = rejection(client.infer, "no-such-model", [text_input(["hi"])])
    assert status == "StatusCode.NOT_FOUND"
    assert "no-such-model" in message
    assert f"{DEFAULT_MODEL}/1" in message
    status, message = rejection(client.infer, DEFAULT_MODEL, [text_input(["hi"])], "9")
    assert status == "StatusCode.NOT_FOUND"
    assert f"{DEFAULT_MODEL}/9" in message


def test_every_modelinfer_is_counted_failed_ones_too(
    omesh: Mesh, client: triton.InferenceServerClient
) -> None:
    """hopline_gateway_requests_total counts a ModelInfer refused before its texts are
    accepted as one, as it counts a refused Predict; an answered one counts its texts (failed
    ModelInfers were in no count, so an error ratio over it read 0: an SRE's probe)."""
    before = int(omesh.gateway_counters()["requests"])
    for _ in range(3):
        rejection(client.infer, "no-such-model", [text_input(["hi"])])
    for _ in range(2):
        rejection(client.infer, DEFAULT_MODEL, [text_input(["where is my parcel", "   "])])
    client.infer(DEFAULT_MODEL, [text_input([f"parcel {uuid.uuid4().hex}" for _ in range(3)])])
    assert int(omesh.gateway_counters()["requests"]) - before == 3 + 2 + 3


def test_bad_tensors_are_invalid_argument(client: triton.InferenceServerClient) -> None:
    fp32 = triton.InferInput("text", [2], "FP32")
    fp32.set_data_from_numpy(np.zeros(2, dtype=np.float32))
    two_d = triton.InferInput("text", [1, 2], "BYTES")
    two_d.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=np.object_))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"inputs": [fp32]}, "expects 'BYTES'"),
        ({"inputs": []}, "expected 1 inputs but got 0"),
        ({"inputs": [text_input(["hi"], name="prompt")]}, "unexpected inference input 'prompt'"),
        ({"inputs": [two_d]}, "unexpected shape"),
        ({"inputs": [text_input(["fine", "  "])]}, "element 1 of input 'text'"),
        (
            {"inputs": [text_input(["fine", "\u200b"])]},
            "element 1 of input 'text' has no character the model reads",
        ),
        (
            {
                "inputs": [text_input(["hi"])],
                "outputs": [triton.InferRequestedOutput("label", class_count=2)],
            },
            "classification applies to output 'scores'",
        ),
        ({"inputs": [text_input(["hi"])], "sequence_id": 7}, "not a sequence model"),
        (  # it was answered as whichever came first: BYTES [1,3] or FP32 [1,26]
            {
                "inputs": [text_input(["hi"])],
                "outputs": [
                    triton.InferRequestedOutput("scores", class_count=3),
                    triton.InferRequestedOutput("scores"),
                ],
            },
            "output 'scores' is requested twice with different parameters",
        ),
        (
            {
                "inputs": [text_input(["hi"])],
                "outputs": [triton.InferRequestedOutput("logits")],
            },
            "unexpected inference output 'logits'",
        ),
        (
            {"inputs": [text_input(["hi"])], "parameters": {"cache_mode": "sometimes"}},
            "cache_mode",
        ),
        ({"inputs": [text_input(["hi"])], "parameters": {"tenant": 7}}, "must be a string"),
        # Echoed in the reply: one near the message limit made the reply unsendable.
        ({"inputs": [text_input(["hi"])], "request_id": "r" * 5000}, "id is 5000 bytes"),
    ]
    for kwargs, needle in cases:
        status, message = rejection(client.infer, DEFAULT_MODEL, client_timeout=30, **kwargs)
        assert status == "StatusCode.INVALID_ARGUMENT", (needle, message)
        assert needle in message, message
    # As Predict: a text over the byte limit is RESOURCE_EXHAUSTED, naming its element.
    status, message = rejection(
        client.infer, DEFAULT_MODEL, [text_input(["fine", "x" * 20_000])], client_timeout=30
    )
    assert status == "StatusCode.RESOURCE_EXHAUSTED", message
    assert "element 1 of input 'text' is 20000 bytes" in message
    # Nothing crashed: the next request is answered.
    assert client.is_server_ready() is True
    ok = client.infer(DEFAULT_MODEL, [text_input(["hello there"])], client_timeout=60)
    assert strings(ok.as_numpy("label"))[0]


def test_classification_returns_the_best_classes_as_triton_does(
    omesh: Mesh, client: triton.InferenceServerClient, labels: list[str]
) -> None:
    """Triton's classification extension (tritonclient's class_count): the k best classes of
    `scores` as BYTES "<score>:<index>:<label>", best first; the same as Predict's top k."""
    texts = TEXTS[:3]
    result = client.infer(
        DEFAULT_MODEL,
        [text_input(texts)],
        outputs=[
            triton.InferRequestedOutput("scores", class_count=3),
            triton.InferRequestedOutput("label"),
        ],
        client_timeout=60,
    )
    (scores,) = [o for o in result.get_response().outputs if o.name == "scores"]
    assert (scores.datatype, list(scores.shape)) == ("BYTES", [3, 3])
    rows = result.as_numpy("scores")
    assert rows.shape == (3, 3)
    for text, row in zip(texts, rows, strict=True):
        expected = predict(omesh, text, top_k=3).prediction.top_k
        parsed = [item.decode().split(":", 2) for item in row]
        assert [label for _, _, label in parsed] == [s.label for s in expected]
        assert [labels[int(index)] for _, index, label in parsed] == [s.label for s in expected]
        for (score, _, _), want in zip(parsed, expected, strict=True):
            assert float(score) == pytest.approx(want.score, abs=1e-6)
    # More classes than the model has: all of them, as Triton clamps.
    every = client.infer(
        DEFAULT_MODEL,
        [text_input(texts[:1])],
        outputs=[triton.InferRequestedOutput("scores", class_count=10_000)],
        client_timeout=60,
    )
    assert every.as_numpy("scores").shape == (1, len(labels))


# -- raw stubs -----------------------------------------------------------------------------


def raw_request(texts: list[bytes], shape: list[int] | None = None) -> Any:
    request = service_pb2.ModelInferRequest(model_name=DEFAULT_MODEL, id="raw-1")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=shape or [len(texts)])
    tensor.contents.bytes_contents.extend(texts)
    request.outputs.add(name="label")
    request.outputs.add(name="score")
    return request


def decode_raw_bytes(blob: bytes) -> list[str]:
    items, offset = [], 0
    while offset < len(blob):
        (size,) = struct.unpack_from("<I", blob, offset)
        items.append(blob[offset + 4 : offset + 4 + size].decode("utf-8"))
        offset += 4 + size
    return items


def test_raw_stubs_with_bytes_contents(omesh: Mesh) -> None:
    texts = TEXTS[:3]
    with grpc.insecure_channel(omesh.gateway) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(raw_request([t.encode() for t in texts]), timeout=60)
        assert reply.id == "raw-1"
        assert [o.name for o in reply.outputs] == ["label", "score"]
        assert [list(o.shape) for o in reply.outputs] == [[3], [3]]
        got = decode_raw_bytes(reply.raw_output_contents[0])
        score = np.frombuffer(reply.raw_output_contents[1], dtype="<f4")
        for i, text in enumerate(texts):
            expected = predict(omesh, text).prediction
            assert got[i] == expected.label
            assert score[i] == pytest.approx(expected.score, rel=1e-5)

        # Shape and data disagree: INVALID_ARGUMENT, as Triton answers.
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(raw_request([b"one", b"two"], shape=[3]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expecting 3" in (info.value.details() or "")
        # A raw BYTES element whose length prefix runs past the data.
        truncated = raw_request([])
        truncated.inputs[0].ClearField("contents")
        truncated.inputs[0].shape[:] = [1]
        truncated.raw_input_contents.append(struct.pack("<I", 50) + b"short")
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(truncated, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "declares 50 bytes" in (info.value.details() or "")
        # A batch over the limit is refused from its shape, before its data is read: a
        # million elements claimed, one sent, the answer is the batch size.
        huge = raw_request([])
        huge.inputs[0].ClearField("contents")
        huge.inputs[0].shape[:] = [1_000_000]
        huge.raw_input_contents.append(struct.pack("<I", 3) + b"one")
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(huge, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch-size must be <= 64" in (info.value.details() or "")
        assert "max_batch_size" in (info.value.details() or "")


# Runs in its own interpreter: hopline's stubs and tritonclient's both define the `inference`
# protobuf package, and one process's default descriptor pool accepts only one of them.
OWN_STUBS = textwrap.dedent(
    """
    import json, sys
    import grpc
    from hopline.protos.hopline.kserve.v2 import grpc_predict_v2_pb2 as pb
    from hopline.protos.hopline.kserve.v2 import grpc_predict_v2_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name=sys.argv[2])
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(sys.argv) - 3])
    tensor.contents.bytes_contents.extend(t.encode() for t in sys.argv[3:])
    request.outputs.add(name="label")
    with grpc.insecure_channel(sys.argv[1]) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    blob, labels = reply.raw_output_contents[0], []
    while blob:
        size = int.from_bytes(blob[:4], "little")
        labels.append(blob[4 : 4 + size].decode())
        blob = blob[4 + size :]
    print(json.dumps(labels))
    """
)


def test_hoplines_own_stubs(omesh: Mesh) -> None:
    texts = TEXTS[:2]
    out = subprocess.run(
        [sys.executable, "-c", OWN_STUBS, omesh.gateway, DEFAULT_MODEL, *texts],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [predict(omesh, t).prediction.label for t in texts]
