"""A served model version as Triton's model configuration, for the KServe front door's
ModelConfig RPC (tritonclient's get_model_config).

The KServe v2 metadata names a version's tensors but has no field for what runs it; Triton's
clients read that from ModelConfig. This one is built from what the inference service reports
running the version (ListModels' providers, after any fallback), never from what the version's
config.json asked for:
- instance_group: KIND_GPU when a GPU provider runs the version, else KIND_CPU;
- optimization.execution_accelerators.gpu_execution_accelerator: "tensorrt" and "cuda", the
  names Triton's ONNX Runtime backend uses, in the order they run;
- parameters: precision, providers (ONNX Runtime's names) and max_texts_per_request (the
  version's max_batch_size, or the gateway's HOPLINE_GATEWAY_MAX_IN_FLIGHT where lower: each
  text of a request takes one of those places).
max_batch_size is 0, Triton's way of saying the dims are whole shapes: the input is one
dimension of texts, as ModelMetadata says, and up to max_texts_per_request go in one request.

The configuration is returned in its JSON form (what tritonclient's as_json prints and
Triton's documentation shows), so it is built and tested without the KServe stubs, whose
protobuf package tritonclient's own stubs claim in the test process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from hopline.model.providers import Provider
from hopline.protos.hopline.inference.v1 import inference_pb2

BACKEND = "onnxruntime"
# Triton's ONNX Runtime backend's accelerator names; the CPU provider is the default kernels.
GPU_ACCELERATORS = {Provider.TENSORRT: "tensorrt", Provider.CUDA: "cuda"}


class Tensor(NamedTuple):
    """An input or output as ModelMetadata describes it: a v2 datatype and a whole shape."""

    name: str
    datatype: str
    shape: Sequence[int]


def config_type(datatype: str) -> str:
    """A v2 datatype's name in a model configuration: BYTES is TYPE_STRING there."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def gpu_accelerators(providers: Sequence[str]) -> list[str]:
    """Triton's names for the GPU providers among `providers`, in their order."""
    return [GPU_ACCELERATORS[Provider(p)] for p in providers if p in GPU_ACCELERATORS]


def triton_config(
    info: inference_pb2.ModelInfo,
    platform: str,
    inputs: Sequence[Tensor],
    outputs: Sequence[Tensor],
    max_texts: int,
) -> dict[str, Any]:
    """`info`'s version as a Triton model configuration, in its JSON form; `max_texts`: the
    most texts one request may carry (0: no limit)."""
    accelerators = gpu_accelerators(info.providers)
    config: dict[str, Any] = {
        "name": info.name,
        "platform": platform,
        "backend": BACKEND,
        "maxBatchSize": 0,
        "input": [_tensor(t) for t in inputs],
        "output": [_tensor(t) for t in outputs],
        "instanceGroup": [
            {
                "name": f"{info.name}_{info.version}",
                "kind": "KIND_GPU" if accelerators else "KIND_CPU",
            }
        ],
        "parameters": {
            "precision": {"stringValue": info.precision},
            "providers": {"stringValue": ",".join(info.providers)},
            "max_texts_per_request": {"stringValue": str(max_texts)},
        },
    }
    if accelerators:
        config["optimization"] = {
            "executionAccelerators": {
                "gpuExecutionAccelerator": [{"name": name} for name in accelerators]
            }
        }
    return config


def _tensor(tensor: Tensor) -> dict[str, Any]:
    return {
        "name": tensor.name,
        "dataType": config_type(tensor.datatype),
        "dims": [str(d) for d in tensor.shape],  # JSON's int64: a string, as protobuf writes it
    }
