"""Stand-ins for the gateway's upstream pools in tests that build a GatewayService without
a mesh: a pool that hands out a given stub, and an inference stub that lists one model."""

from __future__ import annotations

from typing import Any

from hopline.protos.hopline.inference.v1 import inference_pb2


class Models:
    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, **_: Any
    ) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(
            models=[inference_pb2.ModelInfo(name="intents", version="1", labels=["a"])]
        )


class Pool:
    def __init__(self, stub: object) -> None:
        self.target = "inference.test:1"
        self._stub = stub

    def stub(self) -> Any:
        return self._stub

    async def close(self) -> None:
        pass
