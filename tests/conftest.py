from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import Mesh

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
REFERENCE = SHARED / "reference" / "minilm_reference.json"
CLINC = SHARED / "data" / "clinc150" / "data_full.json"
DEFAULT_MODEL = "support-intents"


@pytest.fixture(scope="session")
def default_repo() -> Path:
    """The repository `make` built; tests never build the default model behind its back."""
    repo = Path(os.environ.get("HOPLINE_MODEL_REPO", ROOT / "models")).resolve()
    if not (repo / DEFAULT_MODEL / "1" / "config.json").is_file():
        pytest.fail(f"default model missing in {repo}: run `make model` (make test does)")
    return repo


@pytest.fixture(scope="session")
def reference() -> list[dict[str, Any]]:
    if not REFERENCE.is_file():
        pytest.skip(f"reference embeddings not found at {REFERENCE} (../shared is absent)")
    records: list[dict[str, Any]] = json.loads(REFERENCE.read_text(encoding="utf-8"))["records"]
    return records


@pytest.fixture(scope="module")
def mesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The five services on free ports over a copy of the default repository."""
    work = tmp_path_factory.mktemp("mesh")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    m = Mesh(repo, work)
    try:
        yield m.start()
    finally:
        m.stop()
