"""bench/int8_bound.py: the GEMMs it finds in the default FP32 model, Amdahl's arithmetic, and
a short real measurement on this CPU whose figures must hang together (no figure is asserted
against a speed: the machine's speed is what it measures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopline.bench.int8_bound import amdahl, bound_ratios, int8_bound, weight_gemms
from hopline.model.repository import ModelRepository
from hopline.model.spin import Spin

MODEL = "support-intents"


def test_weight_gemms_are_minilms_six_layers(default_repo: Path) -> None:
    fp32 = ModelRepository(default_repo).resolve(MODEL, "1")
    # Per layer: query, key, value and the attention output (384 -> 384), then the FFN's
    # two (384 -> 1536 -> 384). The attention's products of activations have no weight.
    assert weight_gemms(fp32.file("model")) == {(384, 384): 24, (384, 1536): 6, (1536, 384): 6}


def test_amdahl() -> None:
    assert amdahl(0.0, 3.0) == pytest.approx(1.0)
    assert amdahl(1.0, 3.0) == pytest.approx(3.0)
    assert amdahl(0.8, 2.0) == pytest.approx(1 / (0.4 + 0.2))
    assert 1.0 < amdahl(0.5, 1.8) < 1.8


def test_a_short_measurement_hangs_together(default_repo: Path) -> None:
    fp32 = ModelRepository(default_repo).resolve(MODEL, "1")
    texts = ["I forgot my password", "how do I change the card's pin", "hello there"]
    result = int8_bound(
        fp32, texts, threads=1, spin=Spin.OFF, batches=(4,), iterations=3,
        measured={"batch_4": 1.25},
    )  # fmt: skip
    row = result["batch_4"]
    assert result["weight_gemms"] == 36
    assert row["m"] % 4 == 0  # 4 texts, padded to the longest
    assert row["m"] >= 4 * 3
    profile = row["profile"]
    assert "MatMul" in profile["by_op_ms_per_run"]
    assert 0.0 < profile["gemm_share"] < 1.0
    assert profile["gemm_ms_per_run"] < profile["kernel_ms_per_run"]
    kernel = row["kernel"]
    assert set(kernel["shapes"]) == {
        f"{row['m']}x384x384",
        f"{row['m']}x384x1536",
        f"{row['m']}x1536x384",
    }
    assert kernel["speedup"] == pytest.approx(kernel["fp32_ms"] / kernel["int8_ms"])
    assert row["bound"] == pytest.approx(amdahl(row["gemm_share"], row["kernel_speedup"]))
    assert row["measured"] == 1.25
    assert bound_ratios(result) == {
        "int8 batch_4 bound from its gemms": row["bound"],
        "int8 batch_4 integer gemm speedup": row["kernel_speedup"],
        "fp32 batch_4 gemm share": row["gemm_share"],
    }
