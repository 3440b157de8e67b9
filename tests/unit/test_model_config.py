"""The KServe front door's ModelConfig: a served version as Triton's model configuration.

Each configuration is parsed with tritonclient's own model_config_pb2 (Triton's schema, not
hopline's copy of it), so a field name or enum value Triton does not know fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from hopline.gateway.model_config import Tensor, config_type, gpu_accelerators, triton_config
from hopline.protos.hopline.inference.v1 import inference_pb2

INPUTS = [Tensor("text", "BYTES", [-1])]
OUTPUTS = [Tensor("label", "BYTES", [-1]), Tensor("scores", "FP32", [-1, 3])]
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"


def as_triton(providers: list[str], precision: str = "fp32") -> model_config_pb2.ModelConfig:
    info = inference_pb2.ModelInfo(
        name="intents",
        version="4",
        precision=precision,
        providers=providers,
        max_batch_size=64,
        labels=["a", "b", "c"],
    )
    config: dict[str, Any] = triton_config(info, "hopline", INPUTS, OUTPUTS, max_texts=64)
    return json_format.ParseDict(config, model_config_pb2.ModelConfig())


def test_a_cpu_version_is_a_cpu_instance_with_no_accelerator() -> None:
    config = as_triton([CPU])
    assert config.name == "intents"
    assert config.platform == "hopline"
    assert config.backend == "onnxruntime"
    assert config.max_batch_size == 0
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("text", model_config_pb2.TYPE_STRING, [-1])
    ]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("label", model_config_pb2.TYPE_STRING, [-1]),
        ("scores", model_config_pb2.TYPE_FP32, [-1, 3]),
    ]
    (group,) = config.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert group.name == "intents_4"
    assert not config.HasField("optimization")
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "precision": "fp32",
        "providers": CPU,
        "max_texts_per_request": "64",
    }


@pytest.mark.parametrize(
    ("providers", "accelerators"),
    [([CUDA, CPU], ["cuda"]), ([TENSORRT, CUDA, CPU], ["tensorrt", "cuda"])],
)
def test_a_gpu_version_names_its_accelerators_in_the_order_they_run(
    providers: list[str], accelerators: list[str]
) -> None:
    config = as_triton(providers, precision="fp16")
    (group,) = config.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    gpu = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert [a.name for a in gpu] == accelerators
    assert not config.optimization.execution_accelerators.cpu_execution_accelerator
    assert config.parameters["providers"].string_value == ",".join(providers)
    assert config.parameters["precision"].string_value == "fp16"


def test_every_v2_datatype_has_a_triton_type() -> None:
    for datatype in ("BOOL", "UINT8", "INT8", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES"):
        assert (
            model_config_pb2.DataType.Value(config_type(datatype)) != model_config_pb2.TYPE_INVALID
        )


def test_providers_triton_has_no_accelerator_for_are_left_out() -> None:
    assert gpu_accelerators(["OpenVINOExecutionProvider", CUDA, CPU]) == ["cuda"]
