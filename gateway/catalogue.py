"""The models inference serves, as the gateway knows them.

Re-read every HOPLINE_MODEL_REFRESH_S, and at once (at most once a second) when a request names
a model the gateway has not heard of, so a model added to the repository is served without a
gateway restart and a typo does not turn into a ListModels storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from hopline.gateway.errors import RequestError
from hopline.gateway.upstream import Pool
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc


class ModelCatalogue:
    def __init__(self, inference: Pool[inference_pb2_grpc.InferenceServiceAsyncStub]) -> None:
        self.inference = inference
        self.models: dict[tuple[str, str], inference_pb2.ModelInfo] = {}
        self.latest: dict[str, str] = {}
        self._last_refresh = 0.0
        self._refresh_lock = asyncio.Lock()

    async def refresh(self) -> None:
        response = await self.inference.stub().ListModels(
            inference_pb2.ListModelsRequest(), timeout=5.0
        )
        models = {(m.name, m.version): m for m in response.models}
        latest: dict[str, str] = {}
        for name, version in models:
            if int(version) > int(latest.get(name, "0")):
                latest[name] = version
        self.models, self.latest = models, latest
        self._last_refresh = time.monotonic()

    async def follow(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.refresh()

    async def _find(self, name: str, version: str) -> inference_pb2.ModelInfo | None:
        key = (name, version or self.latest.get(name, ""))
        if key not in self.models and time.monotonic() - self._last_refresh > 1.0:
            async with self._refresh_lock:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.refresh()
            key = (name, version or self.latest.get(name, ""))
        return self.models.get(key)

    async def resolve(self, name: str, version: str) -> inference_pb2.ModelInfo:
        """The model `name` at `version` (the latest when empty); RequestError NOT_FOUND."""
        info = await self._find(name, version)
        if info is None:
            known = ", ".join(sorted(f"{n}/{v}" for n, v in self.models)) or "none"
            wanted = f"{name}/{version}" if version else name
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"unknown model {wanted!r} (serving: {known})"
            )
        return info
