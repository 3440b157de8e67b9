"""hopline: a gRPC microservice mesh for real-time inference with a semantic cache.

The repository root is this package, so every module's import path is its file path:
`services/inference/batched_model.py` is `hopline.services.inference.batched_model`, and the
stubs `make protos` writes beside each contract follow the same rule
(`protos/hopline/cache/v1/cache_pb2.py` is `hopline.protos.hopline.cache.v1.cache_pb2`).
docs/architecture.md walks a request through these folders step by step.
"""

import os as _os

__version__ = "0.1.0"

# ONNX Runtime (1.32) sends usage telemetry to Microsoft (DNS for mobile.events.data.microsoft
# .com from every inference and cache process, and a device id under $HOME/.cache) unless
# this is set: a serving process calls out to no one it was not told to (a deploy probe).
# An operator's own value wins. Set before anything can import onnxruntime.
_os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

# Before any module can import grpc: which threads read gRPC's sockets (runtime/grpc_io.py).
from hopline.runtime import grpc_io as _grpc_io  # noqa: F401
