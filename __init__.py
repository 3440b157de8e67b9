"""hopline: a gRPC microservice mesh for real-time inference with a semantic cache.

The repository root is this package, so every module's import path is its file path:
`services/inference/batched_model.py` is `hopline.services.inference.batched_model`, and the
stubs `make protos` writes beside each contract follow the same rule
(`protos/hopline/cache/v1/cache_pb2.py` is `hopline.protos.hopline.cache.v1.cache_pb2`).
docs/architecture.md walks a request through these folders step by step.
"""

__version__ = "0.1.0"

# Before any module can import grpc: which threads read gRPC's sockets (runtime/grpc_io.py).
from hopline.runtime import grpc_io as _grpc_io  # noqa: F401
