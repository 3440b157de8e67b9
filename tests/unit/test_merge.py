"""Sibling projections merged (hopline.model.merge) on the real MiniLM graph from the bundled
weights: the merged graph computes what the unmerged one computes in FP32 and after dynamic
INT8, with one MatMul per layer where Q, K and V had three; a group it cannot merge whole
is left as it was."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hopline.model.build import DEFAULT_TRAIN_FILE, default_weights_dir, load_examples
from hopline.model.encoder import build_encoder_graph
from hopline.model.merge import merge_sibling_projections
from hopline.model.quantize import quantize_dynamic_int8
from hopline.model.session import embed_texts, make_session
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer

LAYERS = 6


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(default_weights_dir() / "tokenizer.json", DEFAULT_MAX_LENGTH)


@pytest.fixture(scope="module")
def graph() -> onnx.ModelProto:
    return build_encoder_graph(default_weights_dir())


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return ["", "?", *(text for text, _ in load_examples(DEFAULT_TRAIN_FILE)[:40])]


def _embed(path: Path, tokenizer: Any, texts: list[str]) -> Any:
    return embed_texts(make_session(path), tokenizer, texts)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def test_q_k_v_become_one_matmul_that_computes_the_same(
    graph: onnx.ModelProto, tokenizer: Any, texts: list[str], tmp_path: Path
) -> None:
    merged, groups = merge_sibling_projections(graph)

    assert groups == LAYERS
    before, after = _ops(graph), _ops(merged)
    assert after["MatMul"] == before["MatMul"] - 2 * LAYERS
    assert after["Split"] == before["Split"] + LAYERS
    onnx.save(graph, str(tmp_path / "plain.onnx"))
    onnx.save(merged, str(tmp_path / "merged.onnx"))
    want = _embed(tmp_path / "plain.onnx", tokenizer, texts)
    got = _embed(tmp_path / "merged.onnx", tokenizer, texts)
    assert np.abs(want - got).max() < 1e-5


def test_merged_int8_quantizes_each_column_as_before(
    graph: onnx.ModelProto, tokenizer: Any, texts: list[str], tmp_path: Path
) -> None:
    merged, _ = merge_sibling_projections(graph)
    quantize_dynamic_int8(graph, tmp_path / "plain.onnx")
    quantize_dynamic_int8(merged, tmp_path / "merged.onnx")

    assert _ops(onnx.load(str(tmp_path / "merged.onnx")))["MatMulInteger"] == (
        _ops(onnx.load(str(tmp_path / "plain.onnx")))["MatMulInteger"] - 2 * LAYERS
    )
    want = _embed(tmp_path / "plain.onnx", tokenizer, texts)
    got = _embed(tmp_path / "merged.onnx", tokenizer, texts)
    assert np.abs(want - got).max() < 1e-5


def _two_projections(second_bias: bool) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "b")]
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), name)
        for name in ("wa", "wb")
    ] + [numpy_helper.from_array(np.ones(3, np.float32), "bias")]
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["xa"], "ma"),
        helper.make_node("Add", ["xa", "bias"], ["a"], "aa"),
        helper.make_node("MatMul", ["x", "wb"], ["xb" if second_bias else "b"], "mb"),
    ]
    if second_bias:
        nodes.append(helper.make_node("Add", ["xb", "bias"], ["b"], "ab"))
    return helper.make_model(
        helper.make_graph(nodes, "g", [x], outs, inits), opset_imports=[helper.make_opsetid("", 17)]
    )


def test_a_sibling_without_its_own_bias_leaves_the_group_alone() -> None:
    merged, groups = merge_sibling_projections(_two_projections(second_bias=False))
    assert groups == 0
    assert [n.name for n in merged.graph.node] == ["ma", "aa", "mb"]

    merged, groups = merge_sibling_projections(_two_projections(second_bias=True))
    assert groups == 1
    assert _ops(merged) == Counter({"MatMul": 1, "Add": 1, "Split": 1})
