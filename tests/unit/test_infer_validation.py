"""services/inference/service.py:_validate: what an InferRequest's tensors must be before they
share a model run, checked against the default model's real config (no run, no server)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest

from conftest import DEFAULT_MODEL
from hopline.model.repository import ModelConfig, load_config
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.runtime.tensors import TensorError, to_tensor
from hopline.services.inference.service import _listed, _validate

VOCAB = 30522  # MiniLM's


@pytest.fixture
def cfg(default_repo: Path) -> ModelConfig:
    return load_config(default_repo / DEFAULT_MODEL / "1")


def _request(
    ids: npt.NDArray[np.generic], mask: npt.NDArray[np.generic] | None = None
) -> inference_pb2.InferRequest:
    return inference_pb2.InferRequest(
        model=DEFAULT_MODEL,
        inputs=[
            to_tensor("input_ids", ids),
            to_tensor("attention_mask", np.ones_like(ids) if mask is None else mask),
        ],
    )


def _refusal(cfg: ModelConfig, request: inference_pb2.InferRequest) -> str:
    with pytest.raises(TensorError) as refused:
        _validate(cfg, request, VOCAB)
    return str(refused.value)


def test_good_tokens_come_back_as_the_arrays_sent(cfg: ModelConfig) -> None:
    ids = np.array([[101, 0, VOCAB - 1, 102], [101, 7592, 102, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=np.int64)
    arrays = _validate(cfg, _request(ids, mask), VOCAB)
    assert set(arrays) == {"input_ids", "attention_mask"}
    np.testing.assert_array_equal(arrays["input_ids"], ids)
    np.testing.assert_array_equal(arrays["attention_mask"], mask)


@pytest.mark.parametrize("bad", [VOCAB, 10**9, 2**62, -1, -(2**63)])
def test_an_id_outside_the_vocabulary_is_named(cfg: ModelConfig, bad: int) -> None:
    ids = np.array([[101, 7592, 102], [101, bad, 102]], dtype=np.int64)
    assert _refusal(cfg, _request(ids)) == (
        f"input 'input_ids' holds token id {bad}; {DEFAULT_MODEL}/1 takes ids 0 to {VOCAB - 1}"
    )


@pytest.mark.parametrize("bad", [2, -1, 2**40, -(2**63)])
def test_a_mask_holds_only_zeros_and_ones(cfg: ModelConfig, bad: int) -> None:
    ids = np.array([[101, 7592, 102]], dtype=np.int64)
    mask = np.array([[1, bad, 0]], dtype=np.int64)
    assert _refusal(cfg, _request(ids, mask)) == "input 'attention_mask' must hold only 0 and 1"


def test_a_tensor_of_another_dtype_is_named(cfg: ModelConfig) -> None:
    ids = np.array([[101, 7592, 102]], dtype=np.int32)
    assert _refusal(cfg, _request(ids, np.ones_like(ids, dtype=np.int64))) == (
        "input 'input_ids' must be INT64, got INT32"
    )
    request = _request(np.array([[101, 102]], dtype=np.int64))
    request.inputs[1].dtype = 99  # type: ignore[assignment]  # proto3 enums are open
    assert _refusal(cfg, request) == "input 'attention_mask' must be INT64, got unknown dtype 99"


def test_a_float_model_input_is_checked_by_value(cfg: ModelConfig) -> None:
    """A model whose config declares its token inputs FP32 (none bundled does) gets the same
    refusals: the unsigned reading applies to integers only."""
    spec = dataclasses.replace(
        cfg,
        inputs=tuple(dataclasses.replace(s, dtype="FP32") for s in cfg.inputs),
    )
    ok = np.array([[101.0, 7592.0, 102.0]], dtype=np.float32)
    assert set(_validate(spec, _request(ok, np.ones_like(ok)), VOCAB)) == {
        "input_ids",
        "attention_mask",
    }
    for bad in (-5.0, float(VOCAB)):
        ids = np.array([[101.0, bad, 102.0]], dtype=np.float32)
        assert f"holds token id {int(bad)};" in _refusal(spec, _request(ids, np.ones_like(ids)))
    mask = np.array([[1.0, 0.5, 1.0]], dtype=np.float32)
    assert _refusal(spec, _request(ok, mask)) == "input 'attention_mask' must hold only 0 and 1"


def test_a_version_the_model_list_cannot_carry_is_left_out_not_the_whole_list(
    cfg: ModelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """One loaded version whose max_batch_size did not fit ModelInfo's int32 failed every
    ListModels (UNKNOWN), and every gateway's view of every model with it (a helper's
    probe). load_config now refuses such a value; a version the list still cannot carry is
    left out of it, said once. A stand-in for the loaded model: _model_info reads only its
    providers and digest."""
    model = cast(Any, SimpleNamespace(backend=SimpleNamespace(providers=["cpu"]), digest="ab"))
    listed = _listed(cfg, model)
    assert listed is not None
    assert listed.max_batch_size == cfg.max_batch_size
    too_big = dataclasses.replace(cfg, max_batch_size=2**31)
    assert _listed(too_big, model) is None
    assert _listed(too_big, model) is None
    said = [
        r for r in caplog.records if r.getMessage() == "model version left out of the model list"
    ]
    assert len(said) == 1
