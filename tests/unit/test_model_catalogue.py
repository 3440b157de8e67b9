"""gateway/catalogue.py: a model list that cannot be read again is said once, not silently.

Stand-in: the inference pool's stub is an object of the test's that answers ListModels as the
test says (the mesh tests run the real inference service; a ListModels that fails for a
minute on end is the case here, one warning and one line when it is over)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from hopline.gateway.catalogue import ModelCatalogue
from hopline.observability.logs import QUIET_S
from hopline.protos.hopline.inference.v1 import inference_pb2

LISTED = inference_pb2.ListModelsResponse(
    models=[inference_pb2.ModelInfo(name="intents", version="1", ready=True)]
)


class Inference:
    """The pool and its stub: ListModels answers LISTED, or fails with `failing`."""

    def __init__(self) -> None:
        self.failing: grpc.StatusCode | None = None

    def target(self) -> str:
        return "inference"

    def stub(self) -> Inference:
        return self

    async def ListModels(self, request: Any, **_: Any) -> Any:
        if self.failing is not None:
            raise grpc.aio.AioRpcError(
                self.failing, grpc.aio.Metadata(), grpc.aio.Metadata(), "it failed", None
            )
        return LISTED

    async def close(self) -> None:
        return None


def test_a_model_list_that_fails_after_one_was_read_is_said_once_and_when_it_is_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="hopline.gateway.catalogue")
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]

    async def run() -> None:
        inference.failing = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError):
            await catalogue.refresh()  # before any list: the start-up wait says it, not this
        inference.failing = None
        await catalogue.refresh()
        inference.failing = grpc.StatusCode.UNKNOWN
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError):
                await catalogue.refresh()
        assert ("intents", "1") in catalogue.models  # the list read before still serves
        await asyncio.sleep(QUIET_S)
        inference.failing = None
        await catalogue.refresh()

    asyncio.run(run())
    said = [r for r in caplog.records if r.name == "hopline.gateway.catalogue"]
    failed = [r for r in said if r.getMessage().startswith("reading the model list failed")]
    assert [r.getMessage() for r in failed] == [
        "reading the model list failed; serving the list read before",
        "reading the model list failed; serving the list read before: over",
    ]
    assert failed[0].status == "UNKNOWN"  # type: ignore[attr-defined]
    assert failed[1].failures == 20  # type: ignore[attr-defined]
