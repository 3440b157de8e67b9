"""`hopline_queue_depth{component="inference", model}` while two versions of one model queue
requests, each in its own batcher: the model's series is what waits over both."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from hopline.observability import metrics
from hopline.runtime.batching import BatchingPolicy
from hopline.services.inference.backend import Array, Backend
from hopline.services.inference.batched_model import BatchedModel, ModelRequest

MODEL = "queue-depth-two-versions"  # a series of its own: the gauge lives for the process


class _HeldBackend:
    """A version whose runs wait until `go` is set, so what comes after them queues."""

    def __init__(self, version: str) -> None:
        self.config = SimpleNamespace(
            name=MODEL,
            version=version,
            head_embedder=None,
            files={},
            outputs=(),
            batching=BatchingPolicy(max_batch_size=64),
        )
        self.go = threading.Event()

    def run(self, inputs: dict[str, Array], outputs: list[str]) -> dict[str, Array]:
        self.go.wait(timeout=30)
        return {"y": np.zeros((inputs["x"].shape[0], 1), np.float32)}


def _request() -> ModelRequest:
    return ModelRequest({"x": np.zeros((1, 1), np.int64)}, ("y",), 1, 1)


def _depth() -> float:
    return metrics.QUEUE_DEPTH.labels("inference", MODEL).value


async def _until(check: Any) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_the_model_series_counts_what_waits_for_every_version() -> None:
    """Each version's batcher set the model's one series to its own depth: with 3 requests
    waiting for version 1 and 2 for version 2 it read 2, and once version 2's queue
    emptied, 0, with version 1's 3 still waiting."""
    held = _HeldBackend("1"), _HeldBackend("2")

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=2) as executor:
            v1, v2 = (BatchedModel(cast(Backend, b), executor, max_in_flight=1) for b in held)
            calls: list[asyncio.Task[Any]] = []
            try:
                for model, waiting in ((v1, 3), (v2, 2)):
                    # The first runs at once and holds the one run slot; the rest wait.
                    for _ in range(1 + waiting):
                        calls.append(asyncio.create_task(model.infer(_request())))
                        await asyncio.sleep(0)
                await _until(lambda: v1.batcher.waiting_rows == 3 and v2.batcher.waiting_rows == 2)
                assert _depth() == 5

                held[1].go.set()  # version 2 runs what waited for it
                await _until(lambda: v2.batcher.waiting_rows == 0)
                assert _depth() == 3
            finally:
                for backend in held:
                    backend.go.set()
                await v1.close()
                await v2.close()
                await asyncio.gather(*calls, return_exceptions=True)
        # A closed version's requests no longer wait: its part is given back.
        assert _depth() == 0

    asyncio.run(scenario())
