"""A version whose config.json disagrees with its graph is left out at load, and the version
before keeps answering. Such a version (a `logits` width of 27 over a 26-column graph with 27
labels; an input renamed) loaded, was listed as the latest and failed every request that
named no version with INVALID_ARGUMENT, blaming the caller; found by publishing versions
under a running mesh. The real InferenceService and model in this process, without a
server: its ListModels is what the gateway's catalogue calls."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from model_files import reseal

from conftest import DEFAULT_MODEL
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.runtime import config as cfg
from hopline.services.inference.service import InferenceConfig, InferenceService


def wider_logits(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    for output in config["outputs"]:
        if output["name"] == "logits":
            output["shape"] = [-1, 27]
    (folder / "config.json").write_text(json.dumps(config))
    labels = json.loads((folder / "labels.json").read_text())
    (folder / "labels.json").write_text(json.dumps([*labels, "one_more"]))


def renamed_input(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["inputs"][0]["name"] = "ids"
    (folder / "config.json").write_text(json.dumps(config))


def publish(repo: Path, version: str, damage: Callable[[Path], None]) -> None:
    staging = repo / DEFAULT_MODEL / f".staging-{version}"
    shutil.copytree(repo / DEFAULT_MODEL / "1", staging)
    config = json.loads((staging / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps(config | {"version": int(version)}))
    damage(staging)
    reseal(staging)  # a build with that damage, not a copy under way
    staging.rename(repo / DEFAULT_MODEL / version)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (wider_logits, "config.json gives output 'logits' shape [-1, 27]; the graph's is"),
        (renamed_input, "config.json names input 'ids'; the graph's inputs are"),
    ],
)
def test_a_version_whose_config_is_not_its_graphs_is_left_out(
    default_repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: Callable[[Path], None],
    said: str,
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", repo / DEFAULT_MODEL / "1")
    monkeypatch.setenv("HOPLINE_MODEL_REPO", str(repo))
    monkeypatch.setenv("HOPLINE_INFERENCE_THREADS", "1")  # one session: a quicker load

    async def scenario() -> tuple[list[str], dict[Any, str]]:
        service = InferenceService(cfg.load(InferenceConfig, []))
        await service.start()
        publish(repo, "2", damage)
        listing = await service.ListModels(inference_pb2.ListModelsRequest(), None)  # type: ignore[arg-type]
        broken = service.models.broken()
        await service.stop()
        return [m.version for m in listing.models], broken

    versions, broken = asyncio.run(scenario())
    assert versions == ["1"]  # the version before is still the latest
    assert said in broken[(DEFAULT_MODEL, "2")], broken
