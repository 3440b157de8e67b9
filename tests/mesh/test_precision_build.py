"""`hopline model build --precision int8|fp16`: each conversion checked against FP32 before it
is published (and refused, publishing nothing, when it misses), then served by the mesh,
which reports what each version runs on. This machine has no GPU, so an FP16 version that
asks for TensorRT and CUDA runs on the CPU provider, says so in one log line, and ListModels
says CPU; tests/unit/test_providers.py holds the GPU runs, which skip without one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import onnx
import onnxruntime as ort
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.gateway.client import predict
from hopline.model.providers import parse_providers
from hopline.model.run_width import CPU_RUN_ROWS
from hopline.model.session import make_session
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.runtime.batching import DEFAULT_MAX_BATCH

pytestmark = pytest.mark.slow

CPU = "CPUExecutionProvider"
MISS, EXACT = common_pb2.CACHE_OUTCOME_MISS, common_pb2.CACHE_OUTCOME_EXACT


def build(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "model",
            "build",
            "--default",
            "--repo",
            str(repo),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def config(repo: Path, version: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((repo / DEFAULT_MODEL / version / "config.json").read_text())
    return doc


@pytest.fixture(scope="module")
def repo(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default FP32 model as version 1, then an INT8 build (2) and an FP16 build (3)."""
    root = tmp_path_factory.mktemp("precision") / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", root / DEFAULT_MODEL / "1")
    for precision in ("int8", "fp16"):
        done = build(root, "--precision", precision)
        assert done.returncode == 0, done.stderr[-3000:]
    return root


def _op_types(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def _check_figures(cfg: dict[str, Any]) -> dict[str, Any]:
    check: dict[str, Any] = cfg["build"]["precision_check"]
    limits = check["limits"]
    assert check["precision"] == cfg["precision"]
    assert check["texts"] == cfg["build"]["train_examples"]
    assert check["sentences"] > 0
    assert check["heldout_label_agreement"] >= limits["min_label_agreement"]
    assert check["train_label_agreement"] >= 0.99
    assert check["heldout_accuracy_fp32"] - check["heldout_accuracy"] <= limits["max_accuracy_drop"]
    assert check["cosine_mean"] >= limits["min_cosine_mean"]
    assert check["cosine_min"] >= limits["min_cosine"]
    return check


def test_an_int8_build_is_quantized_checked_and_published(repo: Path) -> None:
    cfg = config(repo, "2")
    assert cfg["precision"] == "int8"
    assert cfg["providers"] == ["cpu"]
    assert cfg["dynamic_batching"]["max_batch_size"] == CPU_RUN_ROWS  # a CPU version's runs
    check = _check_figures(cfg)
    assert check["heldout_labels_changed"] < check["texts"]  # a count, not a placeholder
    version = repo / DEFAULT_MODEL / "2"
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= _op_types(version / "model.onnx")
    assert cfg["build"]["graph"] == "rewritten"  # a CPU format, quantized from the unfused graph
    assert sorted(p.name for p in version.iterdir()) == [
        "config.json",
        "labels.json",
        "model.onnx",
        "tokenizer.json",
    ]


def test_an_fp16_build_holds_fp16_weights_and_asks_for_gpus(repo: Path) -> None:
    cfg = config(repo, "3")
    assert cfg["precision"] == "fp16"
    assert cfg["providers"] == [
        {"name": "tensorrt", "engine_cache_dir": "trt-engines", "fp16": True},
        "cuda",
        "cpu",
    ]
    assert cfg["dynamic_batching"]["max_batch_size"] == DEFAULT_MAX_BATCH  # a GPU's runs
    _check_figures(cfg)
    # The check ran where the version runs (CPU here; CUDA on a GPU machine), not on CPU always.
    path = repo / DEFAULT_MODEL / "3" / "model.onnx"
    runs = make_session(path, providers=parse_providers(cfg["providers"])).get_providers()
    assert cfg["build"]["precision_check"]["providers"] == runs
    model = onnx.load(str(repo / DEFAULT_MODEL / "3" / "model.onnx"))
    kinds = [init.data_type for init in model.graph.initializer]
    assert kinds.count(onnx.TensorProto.FLOAT16) > kinds.count(onnx.TensorProto.FLOAT)
    # Callers see the same tensors at every precision.
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {onnx.TensorProto.FLOAT}
    # A GPU version runs ORT's fused graph: a third of the kernel launches (GraphForm).
    assert cfg["build"]["graph"] == "fused"
    assert {"Attention", "SkipLayerNormalization"} <= _op_types(path)


def test_a_build_that_misses_its_check_is_refused_and_publishes_nothing(repo: Path) -> None:
    before = sorted(p.name for p in (repo / DEFAULT_MODEL).iterdir())
    done = build(repo, "--precision", "int8", "--min-cosine-mean", "0.99999")
    assert done.returncode == 1
    assert "int8 build of support-intents refused, nothing published" in done.stderr
    assert "mean embedding cosine 0.9" in done.stderr
    assert "< 0.99999" in done.stderr
    assert sorted(p.name for p in (repo / DEFAULT_MODEL).iterdir()) == before


@pytest.fixture(scope="module")
def pmesh(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("pmesh")
    m = Mesh(repo, work, HOPLINE_CACHE_FLUSH_MS="2", HOPLINE_GATEWAY_EXACT_ENTRIES="0")
    try:
        yield m.start()
    finally:
        m.stop()


def test_list_models_reports_precision_and_what_runs(pmesh: Mesh) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has CUDA: the CPU fallback is not what runs here")
    with grpc.insecure_channel(pmesh.addrs["inference"]) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=30)
    seen = {m.version: (m.precision, list(m.providers)) for m in reply.models}
    assert seen == {"1": ("fp32", [CPU]), "2": ("int8", [CPU]), "3": ("fp16", [CPU])}
    fallbacks = [
        line
        for line in pmesh.log("inference").splitlines()
        if "execution providers fell back" in line
    ]
    assert len(fallbacks) == 1, fallbacks
    assert f"{DEFAULT_MODEL}/3" in fallbacks[0]
    assert "TensorrtExecutionProvider" in fallbacks[0]
    assert f"running=['{CPU}']" in fallbacks[0]


def test_every_precision_answers_and_none_shares_anothers_cache_entries(pmesh: Mesh) -> None:
    text = "I was charged twice for the same order"
    labels = set()
    for version in ("1", "2", "3"):
        reply = predict(text, gateway=pmesh.gateway, model_version=version, timeout_s=60)
        assert (reply.model_version, reply.cache.outcome) == (version, MISS)
        labels.add(reply.prediction.label)
        pmesh.settle()
        again = predict(text, gateway=pmesh.gateway, model_version=version, timeout_s=60)
        assert again.cache.outcome == EXACT
    assert len(labels) == 1
