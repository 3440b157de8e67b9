"""bench/providers.py end to end on this machine (`make bench`'s gpu_providers scenario and
bench/scripts/gpu_providers.py): the README's builds, then what each version runs and how its
answers compare. Here ONNX Runtime has no GPU, so the CUDA and FP16 versions report the CPU
they fall back to; on the lent H100 the same code ran them on CUDA
(bench/results/2026-11-26-h100-cuda-fp16-int8-mesh.json). No mesh: `hopline bench --models`
is tested on its own."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from conftest import REFERENCE
from hopline.bench.providers import providers_scenario

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


def test_the_versions_are_built_compared_and_timed(tmp_path: Path) -> None:
    doc = providers_scenario(
        tmp_path, REFERENCE if REFERENCE.is_file() else None, batches=(1,), iterations=3
    )
    assert doc["environment"]["available_providers"] == ort.get_available_providers()
    agree = doc["agreement"]
    assert list(agree) == ["support-intents/1", "support-intents/2", "support-intents/3"]
    assert agree["support-intents/2"]["asked"] == [CUDA, CPU]
    assert agree["support-intents/3"]["asked"] == [TRT, CUDA, CPU]
    for key in ("support-intents/2", "support-intents/3"):
        row = agree[key]
        if CUDA not in ort.get_available_providers():
            assert row["runs"] == [CPU]
        assert row["cosine_min"] > 0.99
        assert row["labels_changed"] <= 2
        assert row["texts"] == 624
    # FP16's build check ran where the version runs, and says so.
    check = doc["precision_checks"]["support-intents/3"]
    assert check["providers"] == agree["support-intents/3"]["runs"]
    models = doc["compute"]["models"]
    assert list(models) == [
        "support-intents/1 (fp32)",
        "support-intents/2 (fp32)",
        "support-intents/3 (fp16)",
    ]
    assert all(m["batch_1"]["p50_ms"] > 0 for m in models.values())
    assert "mesh" not in doc
