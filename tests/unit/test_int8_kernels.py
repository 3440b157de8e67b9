"""hopline.model.int8_kernels: whether this CPU's int8 kernels saturate, checked against what
ONNX Runtime really computes here. The same tests pass on a CPU with VNNI (nothing saturates,
nothing is flagged) and on one without (8-bit weights saturate and are flagged; 7-bit
weights are exact), so neither kind of CI machine needs a skip."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from hopline.model.int8_kernels import (
    SAFE_WEIGHT_MAGNITUDE,
    cpu_flags,
    read_cpu_flags,
    saturates_here,
    warn_if_saturating,
    widest_int8_weight,
)

DEPTH = 64  # products summed per output: many int16 pairs, as in a real projection


def integer_matmul(path: Path, weight: int) -> Path:
    """A MatMulInteger with every weight `weight` (int8) and a zero activation zero point."""
    w = np.full((DEPTH, 8), weight, dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "a_zero"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, DEPTH])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.uint8), "a_zero")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def computes_exactly(path: Path, weight: int) -> bool:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"a": np.full((16, DEPTH), 255, dtype=np.uint8)})
    return bool((y == 255 * weight * DEPTH).all())


@pytest.mark.parametrize("weight", [127, -128, SAFE_WEIGHT_MAGNITUDE, -SAFE_WEIGHT_MAGNITUDE])
def test_the_flag_check_agrees_with_what_this_cpu_computes(weight: int, tmp_path: Path) -> None:
    model = integer_matmul(tmp_path / "m.onnx", weight)
    assert widest_int8_weight(model) == abs(weight)
    flags = cpu_flags()
    if flags is None:
        pytest.skip("this OS lists no CPU flags (/proc/cpuinfo): nothing to compare with")
    assert computes_exactly(model, weight) is not saturates_here(model, flags)


def test_seven_bit_weights_are_exact_on_every_cpu(tmp_path: Path) -> None:
    model = integer_matmul(tmp_path / "m.onnx", SAFE_WEIGHT_MAGNITUDE)
    avx2_only = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert not saturates_here(model, avx2_only)
    assert computes_exactly(model, SAFE_WEIGHT_MAGNITUDE)


def test_full_range_weights_are_flagged_only_without_int32_dot_products(tmp_path: Path) -> None:
    model = integer_matmul(tmp_path / "m.onnx", 127)
    assert saturates_here(model, frozenset({"avx", "avx2"}))
    assert saturates_here(model, frozenset({"avx2", "avx512f", "avx512bw"}))  # Skylake-SP
    assert not saturates_here(model, frozenset({"avx2", "avx512bw", "avx512_vnni"}))
    assert not saturates_here(model, frozenset({"avx2", "avx_vnni"}))  # Alder Lake, Zen 5
    assert not saturates_here(model, frozenset({"asimd", "asimddp"}))  # Arm: other kernels
    assert not saturates_here(model, None)


def test_cpu_flags_are_read_from_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma\n")
    assert read_cpu_flags(cpuinfo) == frozenset({"fpu", "sse", "avx2", "fma"})
    cpuinfo.write_text("Processor\t: ARMv7\nFeatures\t: neon\n")
    assert read_cpu_flags(cpuinfo) is None
    assert read_cpu_flags(tmp_path / "absent") is None


def test_a_saturating_model_is_named_in_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wide = integer_matmul(tmp_path / "wide.onnx", 127)
    narrow = integer_matmul(tmp_path / "narrow.onnx", SAFE_WEIGHT_MAGNITUDE)
    caplog.set_level(logging.WARNING, "hopline.model.int8_kernels")
    expected = saturates_here(wide, cpu_flags())
    assert warn_if_saturating("support-intents/2", wide) is expected
    assert not warn_if_saturating("support-intents/3", narrow)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == int(expected)
    assert all("support-intents/2" in line and "7 bits" in line for line in lines)
