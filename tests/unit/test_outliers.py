"""INT8's outlier rewrites (hopline.model.outliers) on the real MiniLM graph from the bundled
weights: the rewritten graph computes what FP32 computes, the widest channels take the FP32
path, and the quantized result holds every reference sentence above cosine 0.99, where plain
dynamic INT8 does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from hopline.model.build import DEFAULT_TRAIN_FILE, default_weights_dir, load_examples
from hopline.model.encoder import build_encoder_graph
from hopline.model.int8_kernels import INT8_MAX, PAIR_LIMIT, widest_int8_pair
from hopline.model.limits import CheckLimits
from hopline.model.outliers import (
    SPLIT_CHANNELS,
    Feed,
    activation_ranges,
    calibration_feeds,
    has_outliers,
    prepare_for_int8,
    projections,
)
from hopline.model.quantize import cosines, quantize_dynamic_int8, quantize_int8
from hopline.model.session import embed_texts, make_session
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer

LAYERS = 6
# Issue 16's bar for the reference sentences, above the build's own limit (CheckLimits).
ISSUE_MIN_COSINE = 0.99


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(default_weights_dir() / "tokenizer.json", DEFAULT_MAX_LENGTH)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [text for text, _ in load_examples(DEFAULT_TRAIN_FILE)]


@pytest.fixture(scope="module")
def graph() -> onnx.ModelProto:
    return build_encoder_graph(default_weights_dir())


@pytest.fixture(scope="module")
def feeds(tokenizer: Any, texts: list[str]) -> list[Feed]:
    return calibration_feeds(tokenizer, texts)


@pytest.fixture(scope="module")
def prepared(graph: onnx.ModelProto, feeds: list[Feed]) -> tuple[onnx.ModelProto, list[str]]:
    """The graph rewritten once for the module's tests (about 3.5 s a rewrite)."""
    return prepare_for_int8(graph, feeds)


def _embed(model: onnx.ModelProto | Path, tokenizer: Any, texts: list[str], tmp: Path) -> Any:
    if isinstance(model, onnx.ModelProto):
        onnx.save(model, str(tmp / "m.onnx"))
        model = tmp / "m.onnx"
    return embed_texts(make_session(model), tokenizer, texts)


def test_the_rewritten_graph_computes_what_fp32_computes(
    graph: onnx.ModelProto,
    prepared: tuple[onnx.ModelProto, list[str]],
    tokenizer: Any,
    texts: list[str],
    tmp_path: Path,
) -> None:
    rewritten, _ = prepared
    probe = ["", "?", *texts[:40]]
    want = _embed(graph, tokenizer, probe, tmp_path)
    got = _embed(rewritten, tokenizer, probe, tmp_path)
    assert np.abs(want - got).max() < 1e-4
    # ...and is not the same graph: the projections read smoothed or split inputs, except the
    # attention output's, whose smoothing went into the value projection's weights.
    reads = set(projections(rewritten))
    assert sum(x.endswith(".smoothed") for x in reads) == 2 * LAYERS
    assert 1 <= sum(x.endswith(".inliers") for x in reads) <= LAYERS  # the split's INT8 part
    made_by = {out: n.op_type for n in rewritten.graph.node for out in n.output}
    assert sum(made_by[x] == "Reshape" for x in reads) == LAYERS  # the contexts, as they were
    before = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in rewritten.graph.initializer}
    values = [n for n in before if ".attention.self.value." in n]
    assert len(values) == 2 * LAYERS  # weight and bias
    assert all(not np.array_equal(before[n], after[n]) for n in values)


def test_the_widest_channels_of_the_ffn_input_take_the_fp32_path(
    graph: onnx.ModelProto, feeds: list[Feed], prepared: tuple[onnx.ModelProto, list[str]]
) -> None:
    before = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer}
    ranges = activation_ranges(graph, feeds)
    rewritten, fp32_nodes = prepared
    after = {i.name: numpy_helper.to_array(i) for i in rewritten.graph.initializer}
    nodes = {n.name: n for n in rewritten.graph.node}
    splits = [n for n in rewritten.graph.node if n.op_type == "Split"]
    # MiniLM's FFN inputs: far wider channels in the first layers than in the last.
    made_by = {out: n.op_type for n in graph.graph.node for out in n.output}
    ffn_inputs = [ranges[x] for x in projections(graph) if made_by[x] == "Mul"]  # GELU's
    assert len(ffn_inputs) == LAYERS
    assert [has_outliers(r) for r in ffn_inputs] == [True] * 4 + [False] * 2
    assert len(splits) == 4 == len(fp32_nodes)
    for split, exact in zip(splits, fp32_nodes, strict=True):
        x = split.input[0]
        assert list(after[split.input[1]]) == [len(ranges[x]) - SPLIT_CHANNELS, SPLIT_CHANNELS]
        # The FP32 MatMul reads the split's second part with the rows of the widest channels.
        widest = np.sort(np.argsort(ranges[x])[-SPLIT_CHANNELS:])
        fp32_matmul = nodes[exact]
        assert fp32_matmul.input[0] == split.output[1]
        original = fp32_matmul.input[1].removesuffix(".wide_rows")
        np.testing.assert_array_equal(after[fp32_matmul.input[1]], before[original][widest])
        assert after[original].shape[0] == len(ranges[x]) - SPLIT_CHANNELS
        assert ranges[x][widest].min() >= np.median(ranges[x])


def test_int8_holds_the_reference_sentences_where_plain_int8_does_not(
    graph: onnx.ModelProto,
    feeds: list[Feed],
    tokenizer: Any,
    reference: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    """The figures hold on any x86 CPU: pair-safe weights never saturate
    (test_int8_kernels.py). Measured on an AVX2 CPU: mean 0.9978, worst 0.9910 ("?"), where
    7-bit weights gave 0.9968 / 0.9852; plain INT8's worst is below the build's 0.98 limit."""
    sentences = [r["text"] for r in reference]
    fp32 = _embed(graph, tokenizer, sentences, tmp_path)
    quantize_int8(graph, tmp_path / "int8.onnx", feeds)
    kept = onnx.load(str(tmp_path / "int8.onnx"))
    # Per layer: Q, K and V merged (hopline.model.merge), the attention output, FFN up, down.
    assert sum(n.op_type == "MatMulInteger" for n in kept.graph.node) == 4 * LAYERS
    assert widest_int8_pair(tmp_path / "int8.onnx") <= PAIR_LIMIT
    int8_weights = [
        numpy_helper.to_array(i) for i in kept.graph.initializer if i.data_type == TensorProto.INT8
    ]
    assert max(int(np.abs(w).max()) for w in int8_weights) == INT8_MAX  # wider than 7 bits
    shipped = cosines(_embed(tmp_path / "int8.onnx", tokenizer, sentences, tmp_path), fp32)

    quantize_dynamic_int8(graph, tmp_path / "plain.onnx")  # the same INT8, no rewrites
    plain = cosines(_embed(tmp_path / "plain.onnx", tokenizer, sentences, tmp_path), fp32)
    limits = CheckLimits()
    assert shipped.mean() >= limits.min_cosine_mean
    assert shipped.min() >= limits.min_cosine, sentences[int(shipped.argmin())]
    assert shipped.min() >= ISSUE_MIN_COSINE, sentences[int(shipped.argmin())]
    assert plain.min() < limits.min_cosine  # what the rewrites are for
    assert shipped.mean() > plain.mean()


def test_int8_without_calibration_texts_is_refused(graph: onnx.ModelProto, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="calibration texts"):
        quantize_int8(graph, tmp_path / "int8.onnx", [])
