"""Per-service view of the model repository: loaded models, version resolution, rescans.

Every version in the repository is loaded at start-up, before the service is SERVING. A
version or model written while the services run is picked up on first use, with no time
window in which it is refused:

- `get` on a name or version it has not loaded rescans the repository's listing (a few
  directory reads) and loads the new version there and then (`find`, what request handlers
  call, does both on a worker thread: the event loop serves loaded versions meanwhile);
- `load_new` rescans and loads every version not loaded yet: the inference service runs it
  off its event loop before answering ListModels (which the gateway reads when a request
  names a model it does not know), so that list holds every version the repository holds
  now that loads, and the gateway routes only to versions that have loaded.

A version whose folder is gone leaves at the next rescan: its name resolves to the newest
version left at once (deleting a bad version rolls back), and ListModels stops listing it,
but a request naming it is still served for `linger_s` (callers that have not re-read the
list yet, such as another gateway, keep routing to it until they do); then it is forgotten.
A version whose files changed under the same number is loaded again from them at that
rescan, and served from its old files until that load works: files still being copied over
it, which do not load, leave it served as it was (no NOT_FOUND, no other version answering
for it) and are tried again when they change again. A replaced or forgotten object goes to
`on_retire` (the inference service closes its batcher once idle). `rescan_s`
also rescans at most that often from `get` (the tokenizer and postprocess services, which
are not asked for ListModels): a few directory reads and stats every few seconds.

A caller may say which files it expects a version to have (`find`'s `expect`: the digest the
gateway's model list gives it), so that one request's stages answer from one build of a
version changed in place, though each service reloads it on its own. With `keep_replaced`
the files a reload replaced are kept, and answer callers that still expect them, until the
version changes again or leaves the repository (the gateway's list names the old build until
inference has loaded the new one, and for as long as the new one does not load there: a
model.onnx truncated in place loads in the tokenizer and postprocess, whose files did not
change, and not in inference; when the kept build went after `linger_s` without a miss,
every miss failed UNAVAILABLE until the file was fixed, a helper's probe); a caller that
expects files this service has not loaded makes it rescan there and then, not at its next
refresh (at most once a second per version, whatever the digest: a caller's list may itself
be the stale side, and made-up digests must not make every request a rescan).

Rescans are single-flight: callers that miss while one is running share the next one (a scan
that started before a caller missed may not have seen what the caller wants), so a burst of
requests for an unknown name costs at most two listings. Only complete versions are seen
(`ModelRepository.versions` needs config.json, and `hopline model build` renames a finished
folder into place); a version whose config or files are broken is left out, with a warning,
and looked at again on the next rescan. A version whose loader fails (a model file ONNX
Runtime cannot read) is left out the same way, and is not the latest while it is: its name
resolves to the newest version that loads. It is tried again once its files change, not on
every request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from stat import S_ISREG
from typing import Generic, TypeVar

from hopline.model.repository import (
    CopyUnderWay,
    InvalidModelError,
    ModelConfig,
    ModelNotFoundError,
    ModelRepository,
    load_config,
)
from hopline.runtime.config import SettingError
from hopline.runtime.errors import clip

T = TypeVar("T")
Key = tuple[str, str]
# A version folder's files: name, size, mtime, inode, ctime.
Signature = tuple[tuple[str, int, int, int, int], ...]


def signature(folder: Path) -> Signature:
    """What changes when a version's files are replaced or edited: its files' names, sizes,
    mtimes, inodes and ctimes (a copy that keeps sizes and mtimes, `rsync -a` or `cp -p` of
    a same-length edit, still writes new inodes or changes ctimes). Folders are left out:
    ONNX Runtime writes TensorRT engines into one (a provider's `engine_cache_dir`) while
    the version serves."""
    try:
        files = [(p.name, p.stat()) for p in folder.iterdir()]
    except OSError:
        return ()
    return tuple(
        sorted(
            (name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
            for name, st in files
            if S_ISREG(st.st_mode)
        )
    )


log = logging.getLogger("hopline.model.registry")

# A removed version is served when named for this many HOPLINE_MODEL_REFRESH_S periods: by
# then every gateway has re-read the model list (each does once a period) and stopped routing
# to it.
LINGER_REFRESHES = 2
# How often one caller's expected digest may make a loaded version rescan (`find`'s `expect`).
RECHECK_S = 1.0
# Versions that leave the listing together, several in one scan, are served on for this long
# unless they come back: a sync that empties the folder and copies it again one file at a
# time lists a half-copied folder long before the rest, and each such listing took every
# version not yet back away (a model author's probe: 14 versions let go as the first
# config.json came back, requests naming no version moved from version 14 to 6, requests
# naming version 1 NOT_FOUND, then every version loaded again). One version removed alone,
# an operator's rollback, goes at once.
SYNC_GRACE_S = 60.0
LEFT_OUT_CHARS = 300  # a left-out version's reason, as a caller's NOT_FOUND gives it


class ModelRegistry(Generic[T]):
    def __init__(
        self,
        repo: ModelRepository,
        loader: Callable[[ModelConfig], T],
        *,
        on_retire: Callable[[T], None] | None = None,
        rescan_s: float | None = None,
        linger_s: float = 0.0,
        digest_of: Callable[[T], str] | None = None,
        keep_replaced: bool = False,
    ) -> None:
        self._repo = repo
        self._loader = loader
        self._digest_of = digest_of
        self._keep_replaced = keep_replaced
        # Files a reload replaced, still served to callers that expect them.
        self._replaced: dict[Key, _Kept[T]] = {}
        # When a caller's `expect` last made each version rescan.
        self._rechecked: dict[Key, float] = {}
        self._on_retire = on_retire
        self._linger_s = linger_s
        # Removed versions still served when named, until their deadline (monotonic).
        self._leaving: dict[Key, tuple[float, tuple[ModelConfig, T]]] = {}
        self._rescan_s = rescan_s
        self._next_rescan = math.inf if rescan_s is None else time.monotonic() + rescan_s
        self._configs: dict[Key, ModelConfig] = {}  # every complete version seen
        # The files each config was read from: a version not loaded yet whose files change
        # (labels.json replaced in place) is read again, or it would be loaded with its old
        # config and recorded under its new files, for good.
        self._config_files: dict[Key, Signature] = {}
        self._loaded: dict[Key, tuple[ModelConfig, T]] = {}
        self._files: dict[Key, Signature] = {}  # each loaded version's files when loaded
        self._empty_seen = False  # the last scan found the repository empty (warned once)
        # Loaded versions that left the listing with others (SYNC_GRACE_S): since when.
        self._missing_since: dict[Key, float] = {}
        self._latest: dict[str, str] = {}
        self._broken: dict[Key, str] = {}  # versions left out, with why (logged once)
        self._copying: set[Key] = set()  # of those, the ones seen half copied
        self._unloadable: dict[Key, tuple[Signature, str]] = {}  # the loader failed on these
        self._lock = threading.Lock()
        self._scans_started = 0
        self._scans_done = 0

    def load_all(self) -> list[ModelConfig]:
        """Load every version in the repository; used at start-up, before SERVING."""
        with self._lock:
            self._scan()
            for key in sorted(self._configs):
                self._load(key)
        return [cfg for cfg, _ in self._loaded.values()]

    def check_start(self) -> None:
        """After `load_all` found nothing: start anyway while the repository holds no version
        yet, or only versions still being copied, serving NOT_FOUND until one is published
        (picked up without a restart); a fresh install makes the models' volume before
        anything is published, and the services exited 1 there and crash-looped until
        Kubernetes' restart backoff let them see the first model, up to 5 minutes later (a
        deploy probe), and so did a first version copied by hand, its `model.onnx` not there
        yet (a model author's probe). RuntimeError, saying why, when a version failed to load
        for another reason; SettingError (exit 2) when the repository is not a folder."""
        root = self._repo.root
        if not root.is_dir():
            raise SettingError(
                f"model repository {str(root)!r} (HOPLINE_MODEL_REPO) is not a folder"
            )
        failed = {key: error for key, error in self.broken().items() if key not in self._copying}
        if failed:
            broken = "; ".join(f"{n}/{v}: {e}" for (n, v), e in sorted(failed.items()))
            raise RuntimeError(f"no model in repository {str(root)!r} loads ({broken})")
        if self._copying:
            log.warning(
                "no model in the repository loads yet, its versions still being copied: "
                "requests are NOT_FOUND until one is whole",
                extra={"repository": str(root), "copying": [f"{n}/{v}" for n, v in self._copying]},
            )
            return
        log.warning(
            "no model in the repository yet: requests are NOT_FOUND until one is published",
            extra={"repository": str(root)},
        )

    def load_new(self) -> None:
        """Rescan, then load every version seen and not loaded yet (blocking: run it off the
        event loop); a version that fails to load is left out. A repository that cannot be
        listed (unmounted, its permissions changed) leaves the versions loaded as they were:
        ListModels raised the PermissionError, the gateway read UNKNOWN and a traceback went
        to the log at each re-read, two a second in five processes (a chmod 000 probe)."""
        with self._lock:
            try:
                self._scan()
            except OSError as exc:
                log.warning("model repository rescan failed", extra={"error": str(exc)})
                return
            for key in sorted(self._configs.keys() - self._loaded.keys()):
                self._load(key)

    # -- scanning (under the lock) ---------------------------------------------------------

    def _scan(self) -> None:
        self._scans_started += 1
        configs: dict[Key, ModelConfig] = {}
        config_files: dict[Key, Signature] = {}
        broken: dict[Key, str] = {}
        copying: set[Key] = set()
        for name in self._repo.names():
            try:
                versions = self._repo.versions(name)
                misnamed = self._repo.misnamed(name)
            except OSError as exc:  # one model's folder unreadable: the others are still seen
                self._left_out(broken, (name, ""), f"cannot list {name}/: {exc.strerror or exc}")
                # Its versions loaded serve on as they were, as through a repository that
                # cannot be listed: taken for removed, a model of one version was NOT_FOUND
                # from the next scan on, one of several after SYNC_GRACE_S (a helper's chmod
                # 000 of a model's folder under a running mesh).
                for key in [k for k in self._loaded if k[0] == name]:
                    configs[key], config_files[key] = self._loaded[key][0], self._files[key]
                continue
            for folder in misnamed:
                self._left_out(
                    broken,
                    (name, folder),
                    f"{name}/{folder} is not a version folder: versions are positive integers "
                    "without leading zeros",
                )
            for version in versions:
                key = (name, version)
                files = signature(self._repo.root / name / version)
                if key in self._unloadable:
                    failed_on, error = self._unloadable[key]
                    if files == failed_on:
                        broken[key] = error  # logged when its load failed
                        continue
                    del self._unloadable[key]  # its files changed: try it again
                if key in self._loaded and files != self._files[key]:
                    configs[key], config_files[key] = self._reload(key, files), files
                    continue
                # Read once per version's files (a loaded version's are its load's).
                read_from = self._files.get(key, self._config_files.get(key))
                cfg = self._configs.get(key) if read_from == files else None
                if cfg is None:
                    try:
                        cfg = load_config(self._repo.root / name / version)
                    except InvalidModelError as exc:
                        self._left_out(broken, key, str(exc))
                        if isinstance(exc, CopyUnderWay):
                            copying.add(key)
                        continue
                    if key not in self._configs:
                        log.info("model version found", extra={"model": name, "version": version})
                configs[key], config_files[key] = cfg, files
        if not configs and not broken and self._loaded:
            # A listing with nothing in it is far likelier an unmounted or half-synced volume
            # than an operator removing every model a service serves: keep serving them.
            if not self._empty_seen:
                log.warning(
                    "the model repository lists no model; keeping the versions loaded",
                    extra={"path": str(self._repo.root)},
                )
            self._empty_seen = True
            self._scans_done = self._scans_started
            return
        self._empty_seen = False
        self._keep_synced_away(configs, config_files)
        for key in self._loaded.keys() - configs.keys():
            log.info("model version removed", extra={"model": key[0], "version": key[1]})
            self._leaving[key] = (time.monotonic() + self._linger_s, self._loaded[key])
            self._forget(key)
        for key, (deadline, (_, model)) in list(self._leaving.items()):
            if key in configs or time.monotonic() >= deadline:
                del self._leaving[key]
                self._retire(model)
        for key, kept in list(self._replaced.items()):
            if key not in configs:
                del self._replaced[key]
                self._retire(kept.found[1])
        self._configs, self._config_files, self._broken = configs, config_files, broken
        self._copying = copying
        self._latest = _latest(configs)
        self._scans_done = self._scans_started

    def _keep_synced_away(
        self, configs: dict[Key, ModelConfig], config_files: dict[Key, Signature]
    ) -> None:
        """Add to this scan's listing the loaded versions it misses that left it together
        with others less than SYNC_GRACE_S ago: they are served on as listed."""
        now = time.monotonic()
        gone = sorted(self._loaded.keys() - configs.keys())
        self._missing_since = {k: t for k, t in self._missing_since.items() if k in gone}
        newly = [key for key in gone if key not in self._missing_since]
        if len(newly) > 1:
            log.warning(
                "model versions left the repository together: served on as they were, as "
                "while a sync copies them back, until they have been away this long",
                extra={"versions": [f"{n}/{v}" for n, v in newly], "seconds": SYNC_GRACE_S},
            )
            self._missing_since.update((key, now) for key in newly)
        for key in gone:
            since = self._missing_since.get(key)
            if since is not None and now - since < SYNC_GRACE_S:
                configs[key], config_files[key] = self._loaded[key][0], self._files[key]

    def _left_out(self, broken: dict[Key, str], key: Key, error: str) -> None:
        """A version (or a model's folder) the scan leaves out: said once, until it changes."""
        broken[key] = error
        if self._broken.get(key) != error:
            log.warning(
                "model version left out", extra={"model": key[0], "version": key[1], "error": error}
            )

    def _reload(self, key: Key, files: Signature) -> ModelConfig:
        """A loaded version whose files changed: loaded again from them and swapped in once
        that worked, else served on as loaded (a copy over it seen half done), tried again
        when its files change again. Returns the config served now."""
        name, version = key
        old_cfg, old_model = self._loaded[key]
        self._files[key] = files
        try:
            cfg = load_config(self._repo.root / name / version)
            model = self._loader(cfg)
        except Exception as exc:  # InvalidModelError, or the loader's own (ONNX Runtime's)
            log.warning(
                "model version changed but its files do not load; serving the files loaded "
                "before until they change again",
                extra={"model": name, "version": version, "error": f"{type(exc).__name__}: {exc}"},
            )
            return old_cfg
        self._loaded[key] = (cfg, model)
        log.info(
            "model version changed; loaded from its new files",
            extra={"model": name, "version": version},
        )
        if self._keep_replaced:
            older = self._replaced.get(key)
            self._replaced[key] = _Kept((old_cfg, old_model))
            if older is not None:
                self._retire(older.found[1])
        else:
            self._retire(old_model)
        return cfg

    def _forget(self, key: Key) -> T:
        """Drop a loaded version (requests running on it keep their reference)."""
        if (replaced := self._replaced.pop(key, None)) is not None:
            self._retire(replaced.found[1])
        _, model = self._loaded.pop(key)
        del self._files[key]
        self._configs.pop(key, None)  # published again: its config is read again
        self._config_files.pop(key, None)
        return model

    def _retire(self, model: T) -> None:
        if self._on_retire is not None:
            self._on_retire(model)

    def _rescan_after(self, ticket: int) -> None:
        """Rescan unless one that started after the caller's miss (`ticket`) already ran."""
        with self._lock:
            if self._scans_done <= ticket:
                self._scan()

    def _load(self, key: Key) -> tuple[ModelConfig, T] | None:
        """The loaded version; None when the loader fails on it (then it is left out)."""
        found = self._loaded.get(key)
        if found is None:
            cfg = self._configs[key]
            folder = self._repo.root / cfg.name / cfg.version
            # Taken before the loader reads the files: a change while it reads is seen by
            # the next scan, which loads the version again.
            files = signature(folder)
            try:
                if files != self._config_files.get(key):  # changed since the scan read it
                    cfg = self._configs[key] = load_config(folder)
                    self._config_files[key] = files
                model = self._loader(cfg)
            except InvalidModelError as exc:  # its config, read again, no longer serves
                self._not_loaded(key, files, str(exc))
                return None
            except Exception as exc:  # ONNX Runtime's own errors have no common base
                self._not_loaded(key, files, f"failed to load: {type(exc).__name__}: {exc}")
                return None
            found = (cfg, model)
            self._loaded[key] = found
            self._files[key] = files
            log.info("model loaded", extra={"model": cfg.name, "version": cfg.version})
        return found

    def _not_loaded(self, key: Key, files: Signature, error: str) -> None:
        """A version that failed to load: left out until its files change."""
        log.warning(
            "model version left out", extra={"model": key[0], "version": key[1], "error": error}
        )
        self._unloadable[key] = (files, error)
        self._broken[key] = error
        del self._configs[key]
        self._config_files.pop(key, None)
        self._latest = _latest(self._configs)

    # -- lookups ---------------------------------------------------------------------------

    def _key(self, name: str, version: str) -> Key:
        return (name, version or self._latest.get(name, ""))

    async def find(self, name: str, version: str = "", expect: str = "") -> tuple[ModelConfig, T]:
        """`get` for a service's event loop: a version already loaded is answered on the loop;
        a rescan or a load runs on the loop's default executor, so requests for loaded versions
        are served meanwhile. A load reads and hashes the version's files (version_digest: 58
        ms for the default model), and the inference service's builds and warms two ONNX
        Runtime sessions (about a second): on the loop, a model built while the mesh ran
        stalled every request in the process on its first use (co-located, an exact repeat
        of another model waited 101 ms). `expect`: the module docstring."""
        if not self._rescan_due():
            key = self._key(name, version)
            found = self._loaded.get(key)
            if found is not None and self._differs(found, expect):
                found = self._kept(key, expect) or (
                    None if self._recheck_due(key) or self._lock.locked() else found
                )
            if found is not None:
                return found
        return await asyncio.get_running_loop().run_in_executor(
            None, self.get, name, version, expect
        )

    def _differs(self, found: tuple[ModelConfig, T], expect: str) -> bool:
        """A caller expects other files than the loaded version's."""
        return bool(expect) and self._digest_of is not None and self._digest_of(found[1]) != expect

    def _kept(self, key: Key, expect: str) -> tuple[ModelConfig, T] | None:
        """The files a reload replaced, when they are the ones the caller expects."""
        kept = self._replaced.get(key)
        if kept is None or self._differs(kept.found, expect):
            return None
        return kept.found

    def _recheck_due(self, key: Key) -> bool:
        """No rescan for a caller's `expect` of this version in the last second."""
        return time.monotonic() - self._rechecked.get(key, -math.inf) >= RECHECK_S

    def _recheck(self, key: Key) -> None:
        """A rescan for a caller that expects other files than the loaded ones, unless one ran
        in the last second; one running now is waited for (it holds the lock), so callers
        that came meanwhile get what it loaded, not the files it is replacing."""
        with self._lock:
            if not self._recheck_due(key):
                return
            self._rechecked[key] = time.monotonic()
            try:
                self._scan()
            except OSError as exc:  # a volume going away under the listing: serve on
                log.warning("model repository rescan failed", extra={"error": str(exc)})

    def _rescan_due(self) -> bool:
        return time.monotonic() >= self._next_rescan

    def get(self, name: str, version: str = "", expect: str = "") -> tuple[ModelConfig, T]:
        """The loaded model; rescans and loads on a name or version not loaded yet, or loaded
        from files other than `expect`'s (blocking: a service's request handlers call
        `find`)."""
        key = self._key(name, version)
        loaded = self._loaded.get(key)
        # The periodic rescan first, even for a caller the kept files answer: they may be
        # what every caller expects for as long as inference cannot load the new files, and
        # then only a rescan sees the files fixed.
        if self._rescan_due():
            self._next_rescan = time.monotonic() + (self._rescan_s or math.inf)
            try:
                self._rescan_after(self._scans_started)
            except OSError as exc:  # a volume going away under the listing: serve on
                log.warning("model repository rescan failed", extra={"error": str(exc)})
        elif loaded is not None and self._differs(loaded, expect):
            if (kept := self._kept(key, expect)) is not None:
                return kept
            self._recheck(key)
        key = self._key(name, version)
        found = self._loaded.get(key)
        if found is not None:
            # A rescan may just have replaced the files the caller expects; else it gets what
            # is here, and says so in its reply's digest.
            kept = self._kept(key, expect) if self._differs(found, expect) else None
            return kept or found
        leaving = self._leaving.get((name, version)) if version else None
        if leaving is not None and not (self._repo.root / name / version).exists():
            return leaving[1]  # removed, still served when named: one stat, not a rescan
        ticket = self._scans_started
        self._rescan_after(ticket)
        with self._lock:
            key = self._key(name, version)
            while key in self._configs:  # a version that fails to load leaves the configs
                loaded = self._load(key)
                if loaded is not None:
                    return loaded
                key = self._key(name, version)
            if version and (leaving := self._leaving.get(key)) is not None:
                return leaving[1]  # removed, still served to callers that name it a while
        if key in self._broken:
            raise ModelNotFoundError(f"model {name}/{key[1]} is broken: {self._broken[key]}")
        failed = sorted((k[1], error) for k, error in self._broken.items() if k[0] == name)
        if not version and failed:
            reasons = "; ".join(f"{v}: {error}" for v, error in failed)
            raise ModelNotFoundError(f"no version of model {name!r} loads ({reasons})")
        self._repo.resolve(name, version)  # raises with the repository's own message
        raise ModelNotFoundError(f"model {name!r} version {clip(version)!r} is not loaded")

    def broken(self) -> dict[Key, str]:
        """Versions left out, with why."""
        return dict(self._broken)

    def left_out(self) -> dict[Key, str]:
        """Versions left out and not served, with why as a caller may read it: paths given
        from the repository's root (the server's own folders are not the caller's business),
        and clipped."""
        root = f"{self._repo.root}/"
        return {
            key: clip(error.replace(root, ""), LEFT_OUT_CHARS)
            for key, error in self._broken.items()
            if key not in self._loaded
        }

    def loaded(self) -> list[tuple[ModelConfig, T]]:
        """By name, then version number (ListModels listed 1, 10, 2)."""
        return sorted(self._loaded.values(), key=lambda m: (m[0].name, int(m[0].version)))


class _Kept(Generic[T]):
    """A version's files that a reload replaced (one build a version: the one before)."""

    def __init__(self, found: tuple[ModelConfig, T]) -> None:
        self.found = found


def _latest(configs: dict[Key, ModelConfig]) -> dict[str, str]:
    """Each name's highest version among `configs`."""
    latest: dict[str, str] = {}
    for name, version in configs:
        if int(version) > int(latest.get(name, "0")):
            latest[name] = version
    return latest
