"""The classifier head a version serves cached embeddings with is checked against its labels
at load (services/inference/batched_model.py:EmbeddingHead)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from model_files import reseal
from onnx import TensorProto, helper, numpy_helper

from conftest import DEFAULT_MODEL
from hopline.model.repository import InvalidModelError, load_config
from hopline.services.inference.batched_model import EmbeddingHead


def write_head(path: Path, classes: int, output: str = "logits") -> None:
    """A [batch, 384] x [384, classes] head, as the build writes one."""
    weights = numpy_helper.from_array(np.zeros((384, classes), np.float32), "weights")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["sentence_embedding", "weights"], [output])],
        "head",
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", 384])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", classes])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.fixture
def version(tmp_path: Path, default_repo: Path) -> Path:
    folder = tmp_path / DEFAULT_MODEL / "1"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", folder)
    return folder


def test_the_built_head_loads(version: Path) -> None:
    head = EmbeddingHead(load_config(version))
    labels = len(load_config(version).labels)
    assert head.run(np.zeros((2, head.dim), np.float32)).shape == (2, labels)


def test_a_head_of_another_build_is_refused_at_load(version: Path) -> None:
    """A hand-assembled version with another build's head (23 classes beside 26 labels, its
    checksums written again) loaded, became the latest and failed every cached request with
    INVALID_ARGUMENT, blaming the caller (a model author's probe)."""
    labels = len(load_config(version).labels)
    write_head(version / "head.onnx", labels - 3)
    reseal(version)
    with pytest.raises(InvalidModelError, match=f"{labels - 3} columns .* {labels} labels"):
        EmbeddingHead(load_config(version))


def test_a_head_without_logits_is_refused_at_load(version: Path) -> None:
    write_head(version / "head.onnx", len(load_config(version).labels), output="scores")
    reseal(version)
    with pytest.raises(InvalidModelError, match="no 'logits' output"):
        EmbeddingHead(load_config(version))
