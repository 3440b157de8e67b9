"""Inference backends behind one small interface; ONNX Runtime on CPU is the default.

A backend owns one loaded model version. `run` is blocking and is called from a worker
thread: ONNX Runtime releases the GIL while it computes, so the event loop keeps serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from hopline.model.repository import ModelConfig
from hopline.model.session import make_session

Array = npt.NDArray[np.generic]


class Backend(Protocol):
    config: ModelConfig

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]: ...


class OnnxRuntimeBackend:
    def __init__(self, config: ModelConfig, threads: int, *, spin: bool = False) -> None:
        self.config = config
        self.session = make_session(
            config.file("model"), threads=threads, providers=config.providers, spin=spin
        )
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        names = list(outputs) or self.output_names
        results = self.session.run(names, dict(inputs))
        return dict(zip(names, results, strict=True))


def create_backend(config: ModelConfig, threads: int, *, spin: bool = False) -> Backend:
    if config.backend == "onnxruntime":
        return OnnxRuntimeBackend(config, threads, spin=spin)
    raise ValueError(f"{config.key}: unknown backend {config.backend!r} (have: onnxruntime)")


def warm_up(backend: Backend) -> None:
    """Run the shapes first requests will have, so they do not pay for lazy initialisation."""
    for batch, seq in ((1, 8), (1, 16), (4, 32)):
        ids = np.full((batch, seq), 1000, dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102
        backend.run({"input_ids": ids, "attention_mask": np.ones_like(ids)}, [])
