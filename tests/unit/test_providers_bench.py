"""bench/providers.py's judgement (`make bench`'s gpu_providers rows), on the figures the lent
H100 recorded (bench/results/2026-11-26-h100-cuda-fp16-int8-mesh.json), and what the suite
says where ONNX Runtime has no CUDA."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from hopline.bench.providers import cuda_unavailable, providers_targets

H100 = (
    Path(__file__).resolve().parents[2]
    / "bench"
    / "results"
    / "2026-11-26-h100-cuda-fp16-int8-mesh.json"
)


def _h100() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(H100.read_text(encoding="utf-8"))
    return doc


def test_each_gpu_version_is_judged_on_its_mesh_saving_against_its_model_saving() -> None:
    rows = providers_targets({"gpu_providers": _h100()})
    assert [r["target"].split(" ")[0] for r in rows] == ["support-intents/2", "support-intents/3"]
    fp32, fp16 = rows
    assert "fp32 on CUDAExecutionProvider" in fp32["target"]
    # 10.49 -> 7.67 ms through the mesh; 3.77 -> 1.89 ms of compute in the same bench run.
    assert fp32["value"] == pytest.approx(10.49 - 7.67, abs=0.01)
    assert fp32["limit"] == pytest.approx(3.767 - 1.890, abs=0.01)
    assert fp32["met"]
    assert fp16["met"]


def test_a_mesh_that_loses_the_models_saving_misses_the_target() -> None:
    doc = copy.deepcopy(_h100())
    targets = doc["mesh"]["c1"]["targets"]
    targets["mesh@support-intents:2"]["p50_ms"] = targets["mesh@support-intents:1"]["p50_ms"] - 0.5
    (fp32, _) = providers_targets({"gpu_providers": doc})
    assert fp32["value"] == pytest.approx(0.5)
    assert not fp32["met"]


def test_versions_on_cpu_and_runs_without_a_mesh_give_no_rows() -> None:
    doc = copy.deepcopy(_h100())
    assert [r["met"] for r in providers_targets({"gpu_providers": doc})] == [True, True]
    for row in doc["agreement"].values():
        row["runs"] = ["CPUExecutionProvider"]
    assert providers_targets({"gpu_providers": doc}) == []
    del doc["mesh"]
    assert providers_targets({"gpu_providers": doc}) == []
    assert providers_targets({}) == []


def test_without_cuda_the_suite_is_told_why() -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has CUDA: the suite measures it")
    assert cuda_unavailable() == (
        f"no CUDA in this ONNX Runtime ({', '.join(ort.get_available_providers())})"
    )
