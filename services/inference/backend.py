"""Inference backends behind one small interface; ONNX Runtime on CPU is the default.

A backend owns one loaded model version. `run` is blocking and is called from a worker
thread: ONNX Runtime releases the GIL while it computes, so the event loop keeps serving.
The version's config chooses the execution providers (TensorRT, CUDA, CPU: see
hopline.model.providers); `providers` is what the session actually runs on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from hopline.model.int8_kernels import warn_if_saturating
from hopline.model.providers import session_providers
from hopline.model.quantize import Precision
from hopline.model.repository import ModelConfig
from hopline.model.session import Spin, make_session

Array = npt.NDArray[np.generic]


class Backend(Protocol):
    config: ModelConfig
    providers: tuple[str, ...]  # what runs, best first

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]: ...


class OnnxRuntimeBackend:
    def __init__(self, config: ModelConfig, threads: int, *, spin: Spin = Spin.OFF) -> None:
        self.config = config
        self.session = make_session(
            config.file("model"), threads=threads, providers=config.providers, spin=spin
        )
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.providers = tuple(self.session.get_providers())
        if config.precision is Precision.INT8 and self.providers[0] == "CPUExecutionProvider":
            warn_if_saturating(config.key, config.file("model"))

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        names = list(outputs) or self.output_names
        results = self.session.run(names, dict(inputs))
        return dict(zip(names, results, strict=True))


def create_backend(config: ModelConfig, threads: int, *, spin: Spin = Spin.OFF) -> Backend:
    if config.backend == "onnxruntime":
        return OnnxRuntimeBackend(config, threads, spin=spin)
    raise ValueError(f"{config.key}: unknown backend {config.backend!r} (have: onnxruntime)")


def warm_up(backend: Backend) -> None:
    """Run the shapes first requests will have, so they do not pay for lazy initialisation."""
    for batch, seq in ((1, 8), (1, 16), (4, 32)):
        ids = np.full((batch, seq), 1000, dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102
        backend.run({"input_ids": ids, "attention_mask": np.ones_like(ids)}, [])


def expected_providers(config: ModelConfig) -> tuple[str, ...]:
    """The providers a session for `config` would get here, without creating one."""
    import onnxruntime as ort

    chosen = session_providers(
        config.providers, ort.get_available_providers(), config.file("model").parent
    )
    return tuple(name for name, _ in chosen)
