"""model/registry.py: which versions a service serves when one of them fails to load.

The repository holds real version folders (copies of the default model's config and files);
the loader stands in for ONNX Runtime's session, failing on a model file that reads "broken"
as ONNX Runtime fails on one it cannot parse (the mesh test does it with ONNX Runtime).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from model_files import reseal

from conftest import DEFAULT_MODEL
from hopline.model import registry as registry_module
from hopline.model.registry import ModelRegistry
from hopline.model.repository import (
    ModelConfig,
    ModelNotFoundError,
    ModelRepository,
    version_digest,
)
from hopline.runtime.config import SettingError

BROKEN = b"broken"


class Loader:
    """Loads a version unless its model.onnx reads BROKEN; counts every attempt."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def __call__(self, cfg: ModelConfig) -> str:
        self.attempts.append(cfg.version)
        if (cfg.path / "model.onnx").read_bytes() == BROKEN:
            raise RuntimeError("INVALID_PROTOBUF: Protobuf parsing failed")
        return f"session {cfg.version}"


def publish(default_repo: Path, repo: Path, version: str, broken: bool = False) -> Path:
    folder = repo / DEFAULT_MODEL / version
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", folder)
    config = json.loads((folder / "config.json").read_text())
    config["version"] = int(version)
    (folder / "config.json").write_text(json.dumps(config))
    if broken:  # a build whose model file ONNX Runtime cannot read
        (folder / "model.onnx").write_bytes(BROKEN)
        reseal(folder)
    return folder


@pytest.fixture
def repo(tmp_path: Path, default_repo: Path) -> Path:
    publish(default_repo, tmp_path, "1")
    return tmp_path


def test_a_version_that_fails_to_load_is_left_out_and_is_not_the_latest(
    repo: Path, default_repo: Path
) -> None:
    loader = Loader()
    registry = ModelRegistry(ModelRepository(repo), loader)
    assert [c.version for c in registry.load_all()] == ["1"]
    publish(default_repo, repo, "2", broken=True)

    registry.load_new()  # what ListModels does first
    assert [c.version for c, _ in registry.loaded()] == ["1"]
    assert "Protobuf parsing failed" in registry.broken()[(DEFAULT_MODEL, "2")]
    assert registry.get(DEFAULT_MODEL) == registry.get(DEFAULT_MODEL, "1")
    with pytest.raises(ModelNotFoundError, match="failed to load"):
        registry.get(DEFAULT_MODEL, "2")
    registry.load_new()
    assert loader.attempts == ["1", "2"]  # not tried again while its files are the same


def test_a_request_that_finds_the_new_version_first_gets_the_one_before(
    repo: Path, default_repo: Path
) -> None:
    """No ListModels in between: a rescan has seen version 2 (not loaded yet), so the
    latest is 2 when a request for the latest arrives; it fails to load there and then, and
    the request gets version 1."""
    loader = Loader()
    registry = ModelRegistry(ModelRepository(repo), loader)
    registry.load_all()
    publish(default_repo, repo, "2", broken=True)
    with pytest.raises(ModelNotFoundError):
        registry.get(DEFAULT_MODEL, "7")  # an unknown version: a rescan, which sees 2
    assert loader.attempts == ["1"]
    cfg, session = registry.get(DEFAULT_MODEL)
    assert (cfg.version, session) == ("1", "session 1")
    assert loader.attempts == ["1", "2"]


def test_a_failed_version_is_tried_again_once_its_files_change(
    repo: Path, default_repo: Path
) -> None:
    loader = Loader()
    registry = ModelRegistry(ModelRepository(repo), loader)
    registry.load_all()
    folder = publish(default_repo, repo, "2", broken=True)
    registry.load_new()
    shutil.copyfile(default_repo / DEFAULT_MODEL / "1" / "model.onnx", folder / "model.onnx")
    stat = (folder / "model.onnx").stat()
    os.utime(folder / "model.onnx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    reseal(folder)

    registry.load_new()
    assert loader.attempts == ["1", "2", "2"]
    cfg, session = registry.get(DEFAULT_MODEL)
    assert (cfg.version, session) == ("2", "session 2")
    assert registry.broken() == {}


def test_a_model_none_of_whose_versions_loads_says_why(repo: Path) -> None:
    (repo / DEFAULT_MODEL / "1" / "model.onnx").write_bytes(BROKEN)
    reseal(repo / DEFAULT_MODEL / "1")
    registry = ModelRegistry(ModelRepository(repo), Loader())
    assert registry.load_all() == []
    with pytest.raises(ModelNotFoundError, match=r"no version of model .* loads .*1: failed"):
        registry.get(DEFAULT_MODEL)


def test_a_removed_version_is_let_go_and_its_name_moves_back(
    repo: Path, default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting a bad version is how an operator rolls back: at the next rescan the name
    resolves to the newest version left and the list leaves the removed one out; a request
    naming it is still served for `linger_s` (a gateway that has not re-read the list yet),
    then it is not found, and the object goes to on_retire (the inference service closes
    it)."""
    clock = [1000.0]
    monkeypatch.setattr("hopline.model.registry.time.monotonic", lambda: clock[0])
    retired: list[str] = []
    registry = ModelRegistry(
        ModelRepository(repo), Loader(), on_retire=retired.append, linger_s=20.0
    )
    registry.load_all()
    folder = publish(default_repo, repo, "2")
    registry.load_new()
    assert registry.get(DEFAULT_MODEL)[1] == "session 2"

    shutil.rmtree(folder)
    registry.load_new()

    assert [c.version for c, _ in registry.loaded()] == ["1"]
    assert registry.get(DEFAULT_MODEL)[1] == "session 1"
    assert registry.get(DEFAULT_MODEL, "2")[1] == "session 2"
    assert retired == []
    clock[0] += 20.0
    registry.load_new()
    assert retired == ["session 2"]
    with pytest.raises(ModelNotFoundError, match="no version '2'"):
        registry.get(DEFAULT_MODEL, "2")


def test_a_version_published_again_under_its_number_is_loaded_from_its_new_files(
    repo: Path, default_repo: Path
) -> None:
    """Removed and published again between two rescans (what `hopline model build` does
    after a deletion: the next free number is the same): the new files are loaded."""
    loader = Loader()
    retired: list[str] = []
    registry = ModelRegistry(ModelRepository(repo), loader, on_retire=retired.append)
    registry.load_all()
    folder = publish(default_repo, repo, "2")
    registry.load_new()
    config = json.loads((folder / "config.json").read_text())
    shutil.rmtree(folder)
    config["oos_threshold"] = 0.5
    publish(default_repo, repo, "2")
    (folder / "config.json").write_text(json.dumps(config))

    registry.load_new()

    assert loader.attempts == ["1", "2", "2"]
    assert retired == ["session 2"]
    cfg, _ = registry.get(DEFAULT_MODEL, "2")
    assert cfg.oos_threshold == 0.5


def test_rescan_s_lets_requests_notice_a_removed_version(
    repo: Path, default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer and postprocess services are never asked for ListModels: their `get`
    rescans once `rescan_s` has passed since the last, and not before."""
    clock = [1000.0]
    monkeypatch.setattr("hopline.model.registry.time.monotonic", lambda: clock[0])
    retired: list[str] = []
    registry = ModelRegistry(
        ModelRepository(repo), Loader(), on_retire=retired.append, rescan_s=10.0
    )
    folder = publish(default_repo, repo, "2")
    registry.load_all()
    shutil.rmtree(folder)

    clock[0] += 9.0
    assert registry.get(DEFAULT_MODEL)[1] == "session 2"  # no rescan yet
    clock[0] += 1.0
    assert registry.get(DEFAULT_MODEL)[1] == "session 1"
    assert retired == ["session 2"]  # no linger_s


def test_a_repository_that_lists_nothing_keeps_the_versions_loaded(
    repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unmounted volume or a sync that empties the folder before it copies: removing
    every model a service serves is not what an operator means, so nothing is let go (one
    warning); a version removed while others remain still is."""
    retired: list[str] = []
    registry = ModelRegistry(
        ModelRepository(repo), Loader(), on_retire=retired.append, rescan_s=0.0
    )
    registry.load_all()
    away = repo.parent / f"{repo.name}-away"
    (repo / DEFAULT_MODEL).rename(away)

    registry.load_new()
    assert registry.get(DEFAULT_MODEL)[1] == "session 1"
    assert registry.get(DEFAULT_MODEL, "1")[1] == "session 1"
    assert retired == []
    assert sum("lists no model" in r.getMessage() for r in caplog.records) == 1

    away.rename(repo / DEFAULT_MODEL)
    registry.load_new()
    assert registry.get(DEFAULT_MODEL)[1] == "session 1"


def test_files_copied_over_a_loaded_version_serve_it_as_it_was_until_they_load(
    repo: Path, default_repo: Path
) -> None:
    """A copy over a serving version seen half done (a config not yet whole, then a model
    file ONNX Runtime cannot read yet): the version is served from the files loaded before,
    under its own number and as the latest, and loaded from the new files once they load."""
    loader = Loader()
    retired: list[str] = []
    folder = repo / DEFAULT_MODEL / "1"
    reseal(folder)  # as `hopline model build` writes it, whatever built the default model
    registry = ModelRegistry(ModelRepository(repo), loader, on_retire=retired.append)
    registry.load_all()
    config = json.loads((folder / "config.json").read_text())
    model = (folder / "model.onnx").read_bytes()

    (folder / "config.json").write_text('{"name": ')  # the copy has begun
    registry.load_new()
    assert registry.get(DEFAULT_MODEL, "1")[1] == "session 1"
    assert registry.get(DEFAULT_MODEL)[0].oos_threshold == config["oos_threshold"]

    config["oos_threshold"] = 0.25
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.onnx").write_bytes(BROKEN)  # the model file not yet whole
    registry.load_new()
    registry.load_new()  # the same files: not tried again
    # Not the file config.json names (its checksum): never handed to the loader.
    assert loader.attempts == ["1"]
    cfg, _ = registry.get(DEFAULT_MODEL)
    assert cfg.oos_threshold != 0.25, "the config served must be the loaded model's"
    assert registry.broken() == {}
    assert retired == []

    (folder / "model.onnx").write_bytes(model)  # the copy is done
    registry.load_new()
    assert loader.attempts == ["1", "1"]
    cfg, session = registry.get(DEFAULT_MODEL, "1")
    assert (cfg.oos_threshold, session) == (0.25, "session 1")
    assert retired == ["session 1"]
    assert [c.oos_threshold for c, _ in registry.loaded()] == [0.25]


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_cache(folder: Path, key: str, value: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["cache"][key] = value
    (folder / "config.json").write_text(json.dumps(config))


def _edit_batching(folder: Path, key: str, value: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.setdefault("dynamic_batching", {})[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        # A dtype no tensor can carry: ListModels failed for every model with it (UNKNOWN).
        (
            lambda f: _edit_config(
                f, inputs=[{"name": "input_ids", "dtype": "INT65", "shape": [-1, -1]}]
            ),
            "tensor 'input_ids' has dtype 'INT65'",
        ),
        # Labels that are not strings: the same.
        (
            lambda f: (f / "labels.json").write_text(json.dumps(list(range(26)))),
            "labels.json must be a JSON list of non-empty label strings",
        ),
        # One label fewer than the graph's columns: every answer failed INVALID_ARGUMENT.
        (
            lambda f: (f / "labels.json").write_text(
                json.dumps(json.loads((f / "labels.json").read_text())[:-1])
            ),
            "has 25 labels, but output 'logits' has 26 columns",
        ),
        (lambda f: (f / "labels.json").write_text("[oops"), "labels.json is not JSON"),
        (lambda f: (f / "config.json").write_text("{oops"), "config.json is not JSON"),
        # A TTL past any number (JSON's 1e999): every store was refused by the cache, unsaid.
        (
            lambda f: (f / "config.json").write_text(
                (f / "config.json").read_text().replace('"ttl_s": 3600.0', '"ttl_s": 1e999')
            ),
            "ttl_s > 0 and finite",
        ),
        # Cache values of another JSON type passed the range checks (or raised a bare
        # TypeError in them) and then failed every model-list read, for every model, or
        # stopped the mesh's start (a helper's probe); min_score past 1 stored nothing, unsaid.
        *(
            (lambda f, k=key, v=value: _edit_cache(f, k, v), said)
            for key, value, said in [
                ("max_entries", 2.5, "cache.max_entries must be a whole number, got 2.5"),
                ("max_entries", True, "cache.max_entries must be a whole number, got true"),
                ("max_entries", 1e20, "cache.max_entries must be a whole number"),
                ("max_entries", 2**64, "cache.max_entries must be at most"),
                ("max_entries", "100", 'cache.max_entries must be a whole number, got "100"'),
                ("threshold", "0.9", 'cache.threshold must be a number, got "0.9"'),
                ("ttl_s", "3600", "cache.ttl_s must be a number"),
                ("verify_target", "0.01", "cache.verify_target must be a number"),
                ("min_score", "abc", "cache.min_score must be a number"),
                ("min_score", 5, "0 <= min_score <= 1"),
                ("min_score", -1, "0 <= min_score <= 1"),
                ("min_score", None, "cache.min_score must be a number, got null"),
                ("store_out_of_scope", "false", "cache.store_out_of_scope must be true or false"),
                ("mode", 1, "cache.mode must be a string"),
                ("thresold", 0.9, "unknown cache keys ['thresold']"),
            ]
        ),
        (lambda f: _edit_config(f, cache=[]), "cache must be a JSON object, got list"),
        # A config that is JSON but not an object, or whose files are not: the reason given
        # was Python's "list indices must be integers or slices, not str" (a helper's probe).
        (
            lambda f: (f / "config.json").write_text("[]"),
            "config.json must be a JSON object, got list",
        ),
        (
            lambda f: (f / "config.json").write_text("null"),
            "config.json must be a JSON object, got null",
        ),
        (
            lambda f: _edit_config(f, files=["model.onnx"]),
            "config.json's 'files' must be a JSON object, got list",
        ),
        # Top-level values out of what the services can carry or use (a helper's probe): a
        # max_batch_size past int32 loaded and then failed every model-list read, for every
        # model; a max_sequence_length of 0 failed every request as the client's fault; an
        # oos_threshold of 5 sent every answer out of scope, unsaid.
        *(
            (lambda f, k=key, v=value: _edit_config(f, **{k: v}), said)
            for key, value, said in [
                ("max_batch_size", 3_000_000_000, "max_batch_size must be a whole number from 1"),
                ("max_batch_size", 4.5, "max_batch_size must be a whole number from 1 to"),
                ("max_batch_size", True, "max_batch_size must be a whole number from 1 to"),
                ("max_sequence_length", 0, "max_sequence_length must be a whole number from 1"),
                ("oos_threshold", 5, "oos_threshold must be a number from 0 to 1 (a score)"),
                ("oos_threshold", -1, "oos_threshold must be a number from 0 to 1"),
                (
                    "oos_threshold",
                    "0.3",
                    'oos_threshold must be a number from 0 to 1 (a score), got "0.3"',
                ),
            ]
        ),
        # dynamic_batching values of another JSON type: a float max_batch_size loaded and
        # failed every batched run INTERNAL; a string max_queue_size was refused naming no
        # key; a delay of 1e12 us held a lone request until its deadline.
        *(
            (lambda f, k=key, v=value: _edit_batching(f, k, v), said)
            for key, value, said in [
                ("max_batch_size", 4.5, "dynamic_batching.max_batch_size must be a whole number"),
                (
                    "max_queue_size",
                    "big",
                    'dynamic_batching.max_queue_size must be a whole number, got "big"',
                ),
                ("max_queue_delay_us", 10**12, "max_queue_delay_us must be from 0 to 1000000"),
                ("length_buckets", [8, 16.5], "length_buckets must be a list of whole numbers"),
                ("length_buckets", [], "length_buckets must be a list of whole numbers"),
            ]
        ),
    ],
)
def test_a_version_whose_config_cannot_serve_is_left_out_naming_what_is_wrong(
    repo: Path, default_repo: Path, caplog: pytest.LogCaptureFixture, damage: Any, said: str
) -> None:
    registry = ModelRegistry(ModelRepository(repo), Loader())
    registry.load_all()
    damage(publish(default_repo, repo, "2"))
    registry.load_new()
    assert [cfg.version for cfg, _ in registry.loaded()] == ["1"]
    assert registry.get(DEFAULT_MODEL)[0].version == "1"  # the latest that serves
    assert said in registry.broken()[(DEFAULT_MODEL, "2")]
    registry.load_new()  # said once, not at every scan
    assert [r.getMessage() for r in caplog.records].count("model version left out") == 1


def test_folders_not_named_as_versions_are_said_and_never_the_latest(
    repo: Path, default_repo: Path
) -> None:
    """`0` was loaded but could not be the latest ("unknown model" for a request naming no
    version); `v7` was ignored without a word; `²` passed isdigit() and broke every scan;
    `02` was served beside `2` as another version."""
    registry = ModelRegistry(ModelRepository(repo), Loader())
    registry.load_all()
    for folder in ("0", "v7", "²", "02", ".staging-2-4242"):  # the last: `model build`'s own
        shutil.copytree(repo / DEFAULT_MODEL / "1", repo / DEFAULT_MODEL / folder)
    registry.load_new()
    assert [cfg.version for cfg, _ in registry.loaded()] == ["1"]
    broken = registry.broken()
    assert (DEFAULT_MODEL, ".staging-2-4242") not in broken
    for folder in ("0", "v7", "²", "02"):
        assert (
            "is not a version folder: versions are positive integers"
            in broken[(DEFAULT_MODEL, folder)]
        )
    with pytest.raises(ModelNotFoundError, match="not a version folder"):
        registry.get(DEFAULT_MODEL, "v7")


UNREADABLE_SCAN = """
import json, sys
from pathlib import Path
from hopline.model.registry import ModelRegistry
from hopline.model.repository import ModelRepository

registry = ModelRegistry(ModelRepository(Path(sys.argv[1])), lambda cfg: cfg.key)
registry.load_all()
print(json.dumps({
    "loaded": [cfg.key for cfg, _ in registry.loaded()],
    "broken": {"/".join(k): v for k, v in registry.broken().items()},
}))
"""


def test_an_unreadable_model_folder_leaves_out_that_model_only(default_repo: Path) -> None:
    """A model folder the service's user cannot list (copied under umask 077) made every
    scan fail, so no model was seen at all. The scan runs in a child in a user namespace of
    its own (`unshare --user`: an unprivileged user there, as a service is), where a folder
    of mode 000 cannot be listed even when the test runs as root."""
    top = Path(tempfile.mkdtemp(prefix="hopline-perm-"))
    try:
        top.chmod(0o755)  # pytest's own temporary folders are 0700: the child could not enter
        repo = top / "models"
        publish(default_repo, repo, "1")
        other = repo / "other"
        shutil.copytree(repo / DEFAULT_MODEL, other)
        for version in other.glob("*/config.json"):
            config = json.loads(version.read_text())
            version.write_text(json.dumps({**config, "name": "other"}))
        for path in [top, *top.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        other.chmod(0)
        (repo / "lost+found").mkdir(mode=0)  # a volume's own: no model name, not said
        done = subprocess.run(
            ["unshare", "--user", sys.executable, "-c", UNREADABLE_SCAN, str(repo)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout)
        assert seen["loaded"] == [f"{DEFAULT_MODEL}/1"]
        assert seen["broken"] == {"other/": "cannot list other/: Permission denied"}
    finally:
        (top / "models" / "other").chmod(0o755)
        (top / "models" / "lost+found").chmod(0o755)
        shutil.rmtree(top)


def test_files_replaced_keeping_size_and_mtime_are_loaded_again(
    repo: Path, default_repo: Path
) -> None:
    """`rsync -a` or `cp -p` of a same-length edit keeps sizes and mtimes: the version was
    never loaded again, and served its old files under a digest of its new ones."""
    loader = Loader()
    registry = ModelRegistry(ModelRepository(repo), loader)
    registry.load_all()
    folder = publish(default_repo, repo, "2")
    registry.load_new()
    labels = folder / "labels.json"
    before = labels.stat()
    text = labels.read_text()
    names = json.loads(text)
    first, second = (f'"{name}"' for name in names[:2])
    names[0], names[1] = names[1], names[0]  # the same bytes, in another order
    staged = folder.parent / "labels.staged"
    staged.write_text(text.replace(first, "\0").replace(second, first).replace("\0", second))
    assert staged.stat().st_size == before.st_size
    os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
    staged.replace(labels)
    reseal(folder)

    registry.load_new()

    assert loader.attempts == ["1", "2", "2"]
    assert list(registry.get(DEFAULT_MODEL, "2")[0].labels) == names


def test_files_changed_between_the_scan_and_the_first_load_are_loaded_with_their_config(
    repo: Path, default_repo: Path
) -> None:
    """A scan reads a new version's config; the version loads on its first request, maybe
    much later. Its labels.json replaced in between: it was loaded with the config read
    before (the old labels) and recorded under its new files' signature and digest, so never
    loaded again, and postprocess labelled with the old labels under the new digest."""

    def load(cfg: ModelConfig) -> tuple[tuple[str, ...], str]:
        return tuple(cfg.labels), version_digest(cfg.path)

    registry = ModelRegistry(ModelRepository(repo), load, rescan_s=0.0)
    registry.load_all()
    folder = publish(default_repo, repo, "2")
    registry.get(DEFAULT_MODEL, "1")  # a request's rescan: version 2 seen, not loaded
    assert [cfg.version for cfg, _ in registry.loaded()] == ["1"]
    labels = json.loads((folder / "labels.json").read_text())
    labels[0], labels[1] = labels[1], labels[0]
    staged = folder / "labels.staged"
    staged.write_text(json.dumps(labels))
    staged.replace(folder / "labels.json")
    reseal(folder)

    cfg, (loaded_labels, digest) = registry.get(DEFAULT_MODEL, "2")

    assert list(cfg.labels) == labels
    assert list(loaded_labels) == labels
    assert digest == version_digest(folder)


def test_a_loaded_model_is_answered_on_the_loop_while_a_new_one_loads(
    repo: Path, default_repo: Path
) -> None:
    """`find` (what the services' handlers call) loads a version the registry has not seen
    off the event loop: a request for a loaded model is answered while another model's first
    request waits for its load. The loader is held on an event the test releases, standing
    in for a load that takes long (hashing the files, building ONNX Runtime sessions)."""
    release = threading.Event()
    started = threading.Event()

    def loader(cfg: ModelConfig) -> str:
        if cfg.name == "other-intents":
            started.set()
            assert release.wait(30), "the test never released the load"
        return f"session {cfg.name}"

    registry = ModelRegistry(ModelRepository(repo), loader, rescan_s=3600.0)
    registry.load_all()
    other = repo / "other-intents" / "1"
    shutil.copytree(default_repo / DEFAULT_MODEL / "1", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "name": "other-intents"}))

    async def scenario() -> tuple[bool, str, str]:
        new = asyncio.ensure_future(registry.find("other-intents"))
        # The new model's load has begun, on another thread.
        assert await asyncio.to_thread(started.wait, 10), "the new model's load never began"
        _, loaded = await asyncio.wait_for(registry.find(DEFAULT_MODEL), 10)
        waiting = not new.done()
        release.set()
        _, fresh = await asyncio.wait_for(new, 10)
        return waiting, loaded, fresh

    waiting, loaded, fresh = asyncio.run(scenario())
    assert loaded == f"session {DEFAULT_MODEL}"
    assert waiting, "the loaded model's request was answered only after the new model loaded"
    assert fresh == "session other-intents"


def test_a_version_digest_follows_a_file_edited_in_place_keeping_size_and_mtime(
    repo: Path,
) -> None:
    """version_digest remembers each file's hash by its stat (co-located services fingerprint
    the same files); a same-length edit in place with its mtime put back, as `cp -p` of a
    build with equal sizes does, still changes the ctime, so the file is hashed again."""
    folder = repo / DEFAULT_MODEL / "1"
    labels = folder / "labels.json"
    before = version_digest(folder)
    assert version_digest(folder) == before
    stat = labels.stat()
    text = labels.read_text()
    labels.write_text(text.replace("a", "b", 1))
    os.utime(labels, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert labels.stat().st_size == stat.st_size
    assert labels.stat().st_mtime_ns == stat.st_mtime_ns

    after = version_digest(folder)

    assert after != before
    labels.write_text(text)
    os.utime(labels, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert version_digest(folder) == before


def test_a_copy_over_a_served_version_is_not_loaded_until_its_files_agree(
    repo: Path, default_repo: Path
) -> None:
    """Another build copied over a serving version file by file, labels.json first (a helper's
    probe, `cp` of a build's folder): its labels, as many as before, loaded over the old
    model, and every stage answered the new labels over the old scores for 40 s, cached.
    config.json's checksums tie a build's files together: until every file is the build's,
    the version serves the files it loaded before, and the loader never sees a mix."""
    loader = Loader()
    folder = repo / DEFAULT_MODEL / "1"
    reseal(folder)
    registry = ModelRegistry(ModelRepository(repo), loader)
    registry.load_all()
    old_labels = registry.get(DEFAULT_MODEL, "1")[0].labels

    build = repo.parent / "next-build"  # the new build, made elsewhere
    shutil.copytree(folder, build)
    labels = list(old_labels)
    labels[0], labels[1] = labels[1], labels[0]
    (build / "labels.json").write_text(json.dumps(labels))
    (build / "model.onnx").write_bytes(b"the next build's model")  # the stand-in loader's
    reseal(build)

    for name in ("labels.json", "config.json", "model.onnx"):  # copied one by one
        shutil.copyfile(build / name, folder / name)
        registry.load_new()
        cfg, _ = registry.get(DEFAULT_MODEL, "1")
        if name != "model.onnx":
            assert cfg.labels == old_labels, f"loaded with only {name} copied"
            assert loader.attempts == ["1"]
    assert list(cfg.labels) == labels
    assert loader.attempts == ["1", "1"]
    assert registry.broken() == {}


def test_versions_are_listed_in_number_order(repo: Path, default_repo: Path) -> None:
    """ListModels listed 1, 10, 2 (a model author's probe)."""
    registry = ModelRegistry(ModelRepository(repo), Loader())
    for version in ("10", "2"):
        publish(default_repo, repo, version)
    registry.load_all()
    assert [cfg.version for cfg, _ in registry.loaded()] == ["1", "2", "10"]


def test_a_start_with_no_model_yet_serves_but_a_broken_repository_does_not(
    tmp_path: Path, default_repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A repository that holds no version yet (a fresh install's empty volume) starts, said
    once; one that is not a folder, or whose versions all fail to load, is a broken
    deployment and fails the start saying why (tests/mesh/test_new_model_version.py runs a
    mesh from an empty repository)."""
    empty = tmp_path / "empty"
    (empty / DEFAULT_MODEL / ".staging-1-4242").mkdir(parents=True)  # a build under way
    registry = ModelRegistry(ModelRepository(empty), Loader())
    assert registry.load_all() == []
    with caplog.at_level(logging.WARNING):
        registry.check_start()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "no model in the repository yet: requests are NOT_FOUND until one is published"
    ]
    missing = ModelRegistry(ModelRepository(tmp_path / "typo"), Loader())
    assert missing.load_all() == []
    with pytest.raises(SettingError, match="is not a folder"):  # exit 2
        missing.check_start()
    broken = tmp_path / "broken"
    publish(default_repo, broken, "1", broken=True)
    failing = ModelRegistry(ModelRepository(broken), Loader())
    assert failing.load_all() == []
    with pytest.raises(RuntimeError, match=r"loads \(support-intents/1: .*Protobuf parsing"):
        failing.check_start()


def test_a_start_with_only_a_version_still_being_copied_serves_and_loads_it_when_whole(
    tmp_path: Path, default_repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A first version copied by hand, its config.json there and its model.onnx not yet: the
    services failed to start ("missing model file"), so pods crash-looped where an empty
    repository starts (a model author's probe). It starts, and loads the version once whole."""
    repo = tmp_path / "models"
    folder = publish(default_repo, repo, "1")
    model = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").unlink()
    registry = ModelRegistry(ModelRepository(repo), Loader())
    assert registry.load_all() == []
    with caplog.at_level(logging.WARNING):
        registry.check_start()
    assert any("still being copied" in r.getMessage() for r in caplog.records)
    (folder / "model.onnx").write_bytes(model[: len(model) // 2])  # half written
    registry.load_new()
    assert registry.loaded() == []
    (folder / "model.onnx").write_bytes(model)
    registry.load_new()
    assert [cfg.version for cfg, _ in registry.loaded()] == ["1"]


def test_versions_that_leave_together_are_served_on_while_a_sync_copies_them_back(
    repo: Path, default_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync that empties the folder, then copies it back a file at a time: the listing
    holds a half-copied version long before the rest, and every version not back yet was let
    go (a model author's probe: requests naming no version moved from the newest version to
    the first one back, and requests naming the others NOT_FOUND). Versions that leave
    together are served on, as listed, for SYNC_GRACE_S; one removed alone goes at once
    (test_a_removed_version_is_let_go_and_its_name_moves_back)."""
    clock = [1000.0]
    monkeypatch.setattr("hopline.model.registry.time.monotonic", lambda: clock[0])
    retired: list[str] = []
    registry = ModelRegistry(ModelRepository(repo), Loader(), on_retire=retired.append)
    for version in ("2", "3"):
        publish(default_repo, repo, version)
    registry.load_all()
    away = repo.parent / f"{repo.name}-away"
    (repo / DEFAULT_MODEL).rename(away)
    registry.load_new()  # empty: kept, as before

    first = publish(default_repo, repo, "1")  # the sync's first folder, half copied
    model = (first / "model.onnx").read_bytes()
    (first / "model.onnx").unlink()
    registry.load_new()
    assert registry.get(DEFAULT_MODEL)[1] == "session 3"
    assert [registry.get(DEFAULT_MODEL, v)[1] for v in ("1", "2")] == ["session 1", "session 2"]
    assert [c.version for c, _ in registry.loaded()] == ["1", "2", "3"]

    (first / "model.onnx").write_bytes(model)  # whole; 2 and 3 not back yet
    clock[0] += 30.0
    registry.load_new()
    assert registry.get(DEFAULT_MODEL)[1] == "session 3"
    assert retired == ["session 1"]  # version 1 loaded again from its new files

    clock[0] += 30.0  # away too long: no sync, a removal
    registry.load_new()
    assert [c.version for c, _ in registry.loaded()] == ["1"]
    assert registry.get(DEFAULT_MODEL)[1] == "session 1"
    assert sorted(retired) == ["session 1", "session 2", "session 3"]


def test_load_new_on_an_unreadable_repository_keeps_serving_what_it_loaded(
    tmp_path: Path,
    default_repo: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A repository that cannot be listed while versions serve (a volume remounted, its
    permissions changed): found by making a running mesh's repository mode 000. ListModels
    raised the PermissionError, so each re-read of the gateway's model list got UNKNOWN with a
    traceback in inference's log, two a second in five processes, and a request for a version
    the gateway had not heard of UNAVAILABLE. The listing raises here as the file system did
    (root, which the tests may run as, reads a folder of mode 000)."""
    publish(default_repo, tmp_path, "1")
    repository = ModelRepository(tmp_path)
    registry = ModelRegistry(repository, Loader())
    assert [c.version for c in registry.load_all()] == ["1"]

    def denied() -> list[str]:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(repository, "names", denied)
    # Only the rescan's lines: after another test has set the logger's level, load_all's
    # INFO lines above were captured too (the whole suite in one process).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hopline.model.registry"):
        registry.load_new()  # what ListModels does first: raised PermissionError
    assert [(c.version, m) for c, m in registry.loaded()] == [("1", "session 1")]
    said = [
        r
        for r in caplog.records
        if r.name == "hopline.model.registry" and r.levelno >= logging.WARNING
    ]
    assert [r.getMessage() for r in said] == ["model repository rescan failed"]
    assert "Permission denied" in said[0].error  # type: ignore[attr-defined]

    monkeypatch.undo()  # readable again: a version published meanwhile is loaded
    publish(default_repo, tmp_path, "2")
    registry.load_new()
    assert [c.version for c, _ in registry.loaded()] == ["1", "2"]
    assert registry.get(DEFAULT_MODEL)[1] == "session 2"


@pytest.mark.parametrize("versions", [["1"], ["1", "2"]])
def test_a_model_folder_that_cannot_be_listed_keeps_its_versions_serving(
    tmp_path: Path,
    default_repo: Path,
    versions: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model's folder made unreadable under a running mesh (chmod 000, a helper's probe):
    its versions were taken for removed, a model of one version NOT_FOUND from the next scan
    on and one of several after SYNC_GRACE_S (none here), while an unreadable repository
    kept them all. The folder's listing raises as the file system did for it."""
    monkeypatch.setattr(registry_module, "SYNC_GRACE_S", 0.0)
    for version in versions:
        publish(default_repo, tmp_path, version)
    repository = ModelRepository(tmp_path)
    registry = ModelRegistry(repository, Loader())
    assert [c.version for c in registry.load_all()] == versions
    listing = repository.versions

    def denied(name: str) -> list[str]:
        if name == DEFAULT_MODEL:
            raise PermissionError(13, "Permission denied", str(tmp_path / name))
        return listing(name)

    monkeypatch.setattr(repository, "versions", denied)
    registry.load_new()
    registry.load_new()
    assert [c.version for c, _ in registry.loaded()] == versions
    assert registry.get(DEFAULT_MODEL)[1] == f"session {versions[-1]}"
    assert registry.broken() == {
        (DEFAULT_MODEL, ""): f"cannot list {DEFAULT_MODEL}/: Permission denied"
    }

    monkeypatch.setattr(repository, "versions", listing)  # readable again
    registry.load_new()
    assert [c.version for c, _ in registry.loaded()] == versions
    assert registry.broken() == {}
