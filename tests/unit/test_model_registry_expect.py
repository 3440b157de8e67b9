"""model/registry.py: a caller that says which files of a version it expects (`expect`, the
digest the gateway's model list names) is answered from those files, so the stages of one
request answer from one build of a version changed in place.

The repository holds a real copy of the default model's version; the loader is the
postprocess service's (the digest of the version's files, which is all it keeps besides the
config), and the clock is the test's, so rescans happen when the test says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_files import reseal

from conftest import DEFAULT_MODEL
from hopline.model.registry import RECHECK_S, ModelRegistry
from hopline.model.repository import ModelConfig, ModelRepository, version_digest

REFRESH_S = 10.0
LINGER_S = 20.0


class Clock:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("hopline.model.registry.time.monotonic", lambda: self.now)


class Loads:
    """The postprocess service's loader, counting loads."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, cfg: ModelConfig) -> str:
        self.count += 1
        return version_digest(cfg.path)


@pytest.fixture
def version(tmp_path: Path, default_repo: Path) -> Path:
    folder = tmp_path / DEFAULT_MODEL / "1"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", folder)
    return folder


def swap_two_labels(folder: Path, first: int = 0) -> None:
    """A new build's labels.json written over the old in place, as a sync does."""
    labels_file = folder / "labels.json"
    labels: list[str] = json.loads(labels_file.read_text())
    labels[first], labels[first + 1] = labels[first + 1], labels[first]
    staged = labels_file.with_name("labels.staged")
    staged.write_text(json.dumps(labels))
    staged.replace(labels_file)
    reseal(folder)


def registry(folder: Path, loads: Loads, rescan_s: float) -> ModelRegistry[str]:
    return ModelRegistry(
        ModelRepository(folder.parent.parent),
        loads,
        rescan_s=rescan_s,
        linger_s=LINGER_S,
        digest_of=lambda digest: digest,
        keep_replaced=True,
    )


def test_the_files_a_reload_replaced_answer_callers_that_still_expect_them(
    version: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch)
    models = registry(version, Loads(), REFRESH_S)
    models.load_all()
    old = version_digest(version)
    swap_two_labels(version)
    new = version_digest(version)
    assert new != old

    clock.now += REFRESH_S  # the periodic rescan reloads the version from its new files
    cfg, digest = models.get(DEFAULT_MODEL, "1", expect=old)
    assert digest == old, "a caller that expects the old build got the new one"
    assert cfg.labels[0] != json.loads((version / "labels.json").read_text())[0]
    assert models.get(DEFAULT_MODEL, "1")[1] == new  # no expectation: the newest files
    assert models.get(DEFAULT_MODEL, "1", expect=new)[1] == new

    # Kept however long nobody asks: the gateway's list names them for as long as inference
    # has not loaded the new files (a model.onnx truncated in place: the other stages'
    # files loaded, inference's did not, and once these went after 20 s without a miss,
    # every miss failed UNAVAILABLE, a helper's probe).
    clock.now += 10 * (LINGER_S + REFRESH_S)
    assert models.get(DEFAULT_MODEL, "1")[1] == new
    assert models.get(DEFAULT_MODEL, "1", expect=old)[1] == old
    # Let go when the version changes again (the build before it is kept instead).
    swap_two_labels(version, first=2)
    newer = version_digest(version)
    assert newer not in (old, new)
    clock.now += REFRESH_S
    assert models.get(DEFAULT_MODEL, "1")[1] == newer
    assert models.get(DEFAULT_MODEL, "1", expect=new)[1] == new
    assert models.get(DEFAULT_MODEL, "1", expect=old)[1] == newer


def test_a_caller_that_expects_files_not_loaded_yet_makes_the_version_rescan_at_once(
    version: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without it, a stage that reloads only every refresh period answers a request whose
    other stages have the new build from the old one for up to that long."""
    clock = Clock(monkeypatch)
    loads = Loads()
    models = registry(version, loads, 3600.0)
    models.load_all()
    old = version_digest(version)
    swap_two_labels(version)
    new = version_digest(version)

    assert models.get(DEFAULT_MODEL, "1")[1] == old  # not due to rescan for an hour
    assert models.get(DEFAULT_MODEL, "1", expect=new)[1] == new
    assert loads.count == 2

    # At most one such rescan a second per version, whatever digests callers send.
    swap_two_labels(version)
    newer = version_digest(version)
    assert newer != new
    assert models.get(DEFAULT_MODEL, "1", expect="0123456789abcdef")[1] == new
    assert loads.count == 2
    clock.now += RECHECK_S
    assert models.get(DEFAULT_MODEL, "1", expect="0123456789abcdef")[1] == newer
    assert loads.count == 3
