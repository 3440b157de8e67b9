"""hopline.model.quantize: the pair-safe requantization finds each quantized weight's FP32
source whatever layout and name the installed ONNX Runtime's quantizer gave it. ONNX Runtime
1.30 stores a Gemm's transB weight transposed under its own name, 1.32 under a `_Transposed`
name; a lookup by name alone refused every 1.30 INT8 build (seen on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from hopline.model.quantize import _source_weight, quantize_dynamic_int8


def _init(name: str, w: np.ndarray) -> dict[str, onnx.TensorProto]:
    return {name: numpy_helper.from_array(w.astype(np.float32), name)}


def test_a_weight_stored_transposed_under_its_own_name_is_found_transposed() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(26, 384)).astype(np.float32)  # a classifier head, Gemm transB=1
    found = _source_weight(_init("head.weight_363", w), "head.weight_363", w.T.copy())
    assert found is not None
    np.testing.assert_array_equal(found, w.T)


def test_a_square_weight_takes_the_layout_the_quantizer_stored() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 16)).astype(np.float32)
    step = np.abs(w).max() / 63
    stored_t = np.round(w.T / step) * step  # what a 7-bit quantizer keeps of w.T
    stored = np.round(w / step) * step
    got_t = _source_weight(_init("w", w), "w_Transposed", stored_t)
    got = _source_weight(_init("w", w), "w", stored)
    assert got_t is not None
    assert got is not None
    np.testing.assert_array_equal(got_t, w.T)
    np.testing.assert_array_equal(got, w)
    assert _source_weight(_init("w", w), "other", stored) is None


def test_int8_of_a_square_gemm_with_trans_b_computes_what_fp32_does(tmp_path: Path) -> None:
    """The installed quantizer on a graph with both layouts: a square Gemm(transB=1) (a wrong
    layout would still fit its shape) and a plain MatMul."""
    rng = np.random.default_rng(2)
    gemm_w = rng.normal(scale=0.2, size=(32, 32)).astype(np.float32)
    gemm_b = rng.normal(scale=0.1, size=(32,)).astype(np.float32)
    mm_w = rng.normal(scale=0.2, size=(32, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "gemm_w", "gemm_b"], ["h"], transB=1),
            helper.make_node("MatMul", ["h", "mm_w"], ["y"]),
        ],
        "layouts",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])],
        [
            numpy_helper.from_array(gemm_w, "gemm_w"),
            numpy_helper.from_array(gemm_b, "gemm_b"),
            numpy_helper.from_array(mm_w, "mm_w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    out = tmp_path / "int8.onnx"
    quantize_dynamic_int8(model, out)
    kinds = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert "MatMulInteger" in kinds
    x = rng.normal(size=(64, 32)).astype(np.float32)
    want = (x @ gemm_w.T + gemm_b) @ mm_w
    (got,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    cos = (want * got).sum(axis=1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() > 0.99, cos.min()
