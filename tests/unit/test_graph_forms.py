"""A version's encoder graph takes the form that runs fastest where the version runs: ORT's
fused BERT graph for GPU versions, the rewritten standard-op graph for CPU ones
(model/encoder.py:GraphForm). Both forms, and FP16 converted from the fused one, must give the
unoptimised graph's answers; here they run on the CPU, which has kernels for every fused op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from hopline.model.build import default_weights_dir
from hopline.model.encoder import GraphForm, build_encoder_graph, graph_form, optimize_graph
from hopline.model.providers import parse_providers
from hopline.model.quantize import convert_fp16, cosines
from hopline.model.session import make_session

FUSED_OPS = {"Attention", "SkipLayerNormalization", "EmbedLayerNormalization"}


@pytest.mark.parametrize(
    ("providers", "form"),
    [
        (["cpu"], GraphForm.REWRITTEN),
        (["cuda", "cpu"], GraphForm.FUSED),
        ([{"name": "tensorrt", "fp16": True}, "cuda", "cpu"], GraphForm.FUSED),
    ],
)
def test_gpu_versions_get_the_fused_graph(providers: list[object], form: GraphForm) -> None:
    assert graph_form(parse_providers(providers)) is form


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("forms")
    raw = build_encoder_graph(default_weights_dir())
    paths = {"raw": folder / "raw.onnx"}
    onnx.save(raw, str(paths["raw"]))
    for form in GraphForm:
        paths[form.value] = folder / f"{form.value}.onnx"
        optimize_graph(raw, paths[form.value], form)
    paths["fp16"] = folder / "fp16.onnx"
    convert_fp16(onnx.load(str(paths[GraphForm.FUSED.value])), paths["fp16"])
    return paths


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_the_fused_form_has_a_third_of_the_nodes(graphs: dict[str, Path]) -> None:
    fused, rewritten = _ops(graphs["fused"]), _ops(graphs["rewritten"])
    assert set(fused) >= FUSED_OPS
    assert not FUSED_OPS & set(rewritten)
    assert len(fused) * 2 < len(rewritten) < len(_ops(graphs["raw"]))


def _feed() -> dict[str, np.ndarray]:
    # Right padding in the first row, none in the second: the raw 2-D mask must hold for both.
    ids = np.array(
        [[101, 7592, 2088, 102, 0, 0, 0, 0], [101, 2023, 2003, 1037, 3231, 2005, 2017, 102]],
        np.int64,
    )
    return {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)}


def test_every_form_gives_the_unoptimised_answers(graphs: dict[str, Path]) -> None:
    (want,) = make_session(graphs["raw"]).run(["sentence_embedding"], _feed())
    for form in GraphForm:
        (got,) = make_session(graphs[form.value]).run(["sentence_embedding"], _feed())
        assert np.abs(got - want).max() < 1e-4, form
    (fp16,) = make_session(graphs["fp16"]).run(["sentence_embedding"], _feed())
    assert fp16.dtype == np.float32  # callers see FP32 at every precision
    assert cosines(want, fp16).min() > 0.999


def test_fp16_from_the_fused_graph_holds_fp16_weights(graphs: dict[str, Path]) -> None:
    model = onnx.load(str(graphs["fp16"]))
    kinds = [init.data_type for init in model.graph.initializer]
    assert kinds.count(onnx.TensorProto.FLOAT16) > kinds.count(onnx.TensorProto.FLOAT)
    assert {n.op_type for n in model.graph.node} >= FUSED_OPS
