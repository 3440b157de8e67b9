"""KServe requested outputs (gateway/open_inference.py:requested_outputs): an output asked for
twice with different parameters was answered as whichever came first (`scores` with
classification 3, then plain `scores`, gave the classification; the other order the scores),
found by a tritonclient probe. Now refused; the same output asked twice alike is answered once."""

from __future__ import annotations

import grpc
import pytest

from hopline.gateway.open_inference import CLASSIFICATION, CLASSIFIED, Requested, requested_outputs
from hopline.protos.hopline.kserve.v2 import grpc_predict_v2_pb2 as pb
from hopline.runtime.errors import StatusError


def output(name: str, classes: int = 0) -> pb.ModelInferRequest.InferRequestedOutputTensor:
    tensor = pb.ModelInferRequest.InferRequestedOutputTensor(name=name)
    if classes:
        tensor.parameters[CLASSIFICATION].int64_param = classes
    return tensor


def test_an_output_asked_twice_differently_is_refused() -> None:
    for first, second in ((3, 0), (0, 3), (2, 3)):
        request = pb.ModelInferRequest(
            outputs=[output(CLASSIFIED, first), output(CLASSIFIED, second)]
        )
        with pytest.raises(StatusError) as info:
            requested_outputs(request, "m")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "requested twice" in info.value.message


def test_an_output_asked_twice_alike_is_answered_once() -> None:
    request = pb.ModelInferRequest(outputs=[output(CLASSIFIED, 3), output(CLASSIFIED, 3)])
    assert requested_outputs(request, "m") == [Requested(CLASSIFIED, 3)]
