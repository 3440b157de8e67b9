"""A model version removed or replaced while the inference service runs gives its memory
back. Two defects, found by adding and removing versions under a running service: the
version loaded at start-up is frozen out of the collector's reach (runtime/collector.py)
and its batcher's run, the model's own method, made a cycle, so it was never freed; and
the versions that were freed left their sessions' memory in the allocator's per-thread
arenas (runtime/memory.py), so the service grew by about 650 MiB for every three versions
added and removed. The real InferenceService and model in this process, without a server:
its ListModels is what the gateway's catalogue calls, and what loads and retires versions.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest

from conftest import DEFAULT_MODEL
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.runtime import config as cfg
from hopline.runtime import memory
from hopline.runtime.collector import settle
from hopline.services.inference.service import InferenceConfig, InferenceService

REFRESH_S = 0.2  # versions removed are let go two of these after the scan that saw it


def publish(repo: Path, version: str) -> None:
    staging = repo / DEFAULT_MODEL / f".staging-{version}"
    shutil.copytree(repo / DEFAULT_MODEL / "1", staging)
    config = json.loads((staging / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps(config | {"version": int(version)}))
    staging.rename(repo / DEFAULT_MODEL / version)


def test_a_removed_start_up_version_is_freed_and_its_memory_released(
    default_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", repo / DEFAULT_MODEL / "1")
    monkeypatch.setenv("HOPLINE_MODEL_REPO", str(repo))
    monkeypatch.setenv("HOPLINE_MODEL_REFRESH_S", str(REFRESH_S))
    released: list[bool] = []

    def release() -> bool:
        released.append(memory.release_freed_memory())
        return released[-1]

    monkeypatch.setattr("hopline.services.inference.service.release_freed_memory", release)

    async def scenario() -> weakref.ref[object]:
        service = InferenceService(cfg.load(InferenceConfig, []))
        await service.start()
        ((_, first),) = service.models.loaded()
        sessions: weakref.ref[object] = weakref.ref(first.backend)
        del first
        settle()  # as a serving process does once ready: start-up's objects frozen
        publish(repo, "2")
        listing = inference_pb2.ListModelsRequest()
        await service.ListModels(listing, None)  # type: ignore[arg-type]
        shutil.rmtree(repo / DEFAULT_MODEL / "1")
        for _ in range(100):
            await asyncio.sleep(REFRESH_S / 2)
            versions = [m.version for m in (await service.ListModels(listing, None)).models]  # type: ignore[arg-type]
            if sessions() is None and released:
                break
        assert versions == ["2"]
        await service.stop()
        return sessions

    try:
        gone = asyncio.run(scenario())
    finally:
        gc.unfreeze()
    assert gone() is None, "version 1's sessions are still referenced"
    assert released, "the freed memory was not given back"
