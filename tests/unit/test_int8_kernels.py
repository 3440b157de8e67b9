"""hopline.model.int8_kernels: which int8 weights this CPU's kernels compute exactly, checked
against what ONNX Runtime really computes here. The same tests pass on a CPU with VNNI
(nothing saturates, nothing is flagged) and on one without (wide same-sign pairs saturate and
are flagged; pair-safe weights are exact), so neither kind of CI machine needs a skip."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from hopline.model.int8_kernels import (
    INT8_MAX,
    PAIR_LIMIT,
    cpu_flags,
    pair_safe_int8,
    read_cpu_flags,
    saturates_here,
    warn_if_saturating,
    widest_int8_pair,
    widest_pair,
)

DEPTH = 64  # products summed per output: many int16 pairs, as in a real projection
WIDTH = 8


def integer_matmul(path: Path, w: npt.NDArray[np.int8]) -> Path:
    """A MatMulInteger with int8 weight `w` [K, N] and a zero activation zero point."""
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "a_zero"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.uint8), "a_zero")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def paired(first: int, second: int) -> npt.NDArray[np.int8]:
    """Every pair of rows (2i, 2i+1) of a [DEPTH, WIDTH] weight holding (first, second)."""
    column = np.tile(np.array([first, second], dtype=np.int8), DEPTH // 2)
    return np.repeat(column[:, None], WIDTH, axis=1)


def computes_exactly(path: Path, w: npt.NDArray[np.int8], a: npt.NDArray[np.uint8]) -> bool:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"a": a})
    return bool((y == a.astype(np.int64) @ w.astype(np.int64)).all())


def full_activations(rows: int = 16) -> npt.NDArray[np.uint8]:
    return np.full((rows, DEPTH), 255, dtype=np.uint8)


PAIRS = [(127, 127), (-127, -127), (64, 64), (-64, -64), (127, 1), (127, 2), (-100, -29),
         (127, -127), (-127, 127), (100, 28)]  # fmt: skip


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_the_flag_check_agrees_with_what_this_cpu_computes(
    first: int, second: int, tmp_path: Path
) -> None:
    w = paired(first, second)
    model = integer_matmul(tmp_path / "m.onnx", w)
    same_sign = (first > 0) == (second > 0)
    assert widest_int8_pair(model) == (abs(first) + abs(second) if same_sign else 0)
    flags = cpu_flags()
    if flags is None:
        pytest.skip("this OS lists no CPU flags (/proc/cpuinfo): nothing to compare with")
    assert computes_exactly(model, w, full_activations()) is not saturates_here(model, flags)


def test_pair_safe_weights_are_exact_on_this_cpu_and_finer_than_seven_bits(
    tmp_path: Path,
) -> None:
    """Heavy-tailed weights (as MiniLM's are): every same-sign pair within the limit, every
    value within int8, each channel as fine as 7 bits or finer, and ORT's product exact
    whatever this CPU's kernels are."""
    rng = np.random.default_rng(7)
    w = (rng.standard_t(3, size=(DEPTH * 6, 48)) * 0.05).astype(np.float32)
    q, scale = pair_safe_int8(w)
    assert q.dtype == np.int8
    assert scale.shape == (48,)
    assert widest_pair(q) <= PAIR_LIMIT
    assert np.abs(q).max() <= INT8_MAX
    absmax = np.abs(w).max(axis=0)
    assert (scale <= absmax / 64 + 1e-9).all()  # never coarser than 7 bits ([-64, 64])
    assert (scale < absmax / 64).mean() > 0.5  # and most channels finer
    assert (np.abs(q * scale - w) <= scale / 2 + 1e-6).all()  # rounded, not clipped
    model = integer_matmul(tmp_path / "m.onnx", q)
    activations = rng.integers(0, 256, size=(16, q.shape[0]), dtype=np.uint8)
    activations[:4] = 255  # the rows most likely to overflow a pair
    assert computes_exactly(model, q, activations)


def test_an_odd_depth_pairs_its_last_row_with_nothing() -> None:
    w = np.array([[1.0, -1.0], [1.0, 0.5], [1.0, 1.0]], dtype=np.float32)
    q, _ = pair_safe_int8(w)
    assert widest_pair(q) <= PAIR_LIMIT
    assert widest_pair(np.array([[127], [127], [127]], dtype=np.int8)) == 254
    assert widest_pair(np.array([[0], [0], [127]], dtype=np.int8)) == 0  # beside the padding


def test_wide_pairs_are_flagged_only_without_int32_dot_products(tmp_path: Path) -> None:
    model = integer_matmul(tmp_path / "m.onnx", paired(127, 127))
    assert saturates_here(model, frozenset({"avx", "avx2"}))
    assert saturates_here(model, frozenset({"avx2", "avx512f", "avx512bw"}))  # Skylake-SP
    assert not saturates_here(model, frozenset({"avx2", "avx512bw", "avx512_vnni"}))
    assert not saturates_here(model, frozenset({"avx2", "avx_vnni"}))  # Alder Lake, Zen 5
    assert not saturates_here(model, frozenset({"asimd", "asimddp"}))  # Arm: other kernels
    assert not saturates_here(model, None)
    alternating = integer_matmul(tmp_path / "alt.onnx", paired(127, -127))
    assert not saturates_here(alternating, frozenset({"avx", "avx2"}))


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
    wide = integer_matmul(tmp_path / "wide.onnx", paired(127, 127))
    narrow = integer_matmul(tmp_path / "narrow.onnx", paired(127, 1))
    caplog.set_level(logging.WARNING, "hopline.model.int8_kernels")
    expected = saturates_here(wide, cpu_flags())
    assert warn_if_saturating("support-intents/2", wide) is expected
    assert not warn_if_saturating("support-intents/3", narrow)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == int(expected)
    assert all("support-intents/2" in line and "Rebuild" in line for line in lines)
