"""Which version a `hopline model build` publishes, held against another build of it.

Two builds of one version both ran for the whole build (a minute and more) and the second
then failed at the rename; two builds picking the next free version picked the same one. A
build now holds an exclusive lock on `<name>/.build-<version>.lock` from the start: a named
version another build holds is refused at once, and a picked one moves on to the next free
number. The lock is the kernel's (flock), so a build killed by any signal lets go of it
(its empty lock file stays; the next build of that version uses it).

A build killed before its own clean-up could run (SIGKILL, a machine's crash) leaves its
`.staging-<version>-<pid>` folder behind; the next build of that model removes the ones whose
version no build holds. Services never read dot-folders, so a leftover costs only disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from hopline.model.repository import ModelRepository, is_version

STAGING_PREFIX = ".staging-"


class VersionBusyError(FileExistsError):
    """Another build holds the version asked for."""


def staging_dir(model_dir: Path, version: str) -> Path:
    return model_dir / f"{STAGING_PREFIX}{version}-{os.getpid()}"


@contextlib.contextmanager
def claimed(repo_root: Path, name: str, version: str | None) -> Iterator[str]:
    """The version this build publishes (`version`, or the next one free), held until exit.

    Raises VersionBusyError when `version` is named and another build holds it, and
    FileExistsError when it is published already.
    """
    if version is not None and not is_version(version):  # `01` would be built, never served
        raise ValueError(f"version {version!r} must be a positive integer, without leading zeros")
    model_dir = repo_root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    _remove_orphans(model_dir)
    picked = version or ModelRepository(repo_root).next_version(name)
    while True:
        lock = model_dir / f".build-{picked}.lock"
        held = _try_lock(lock)
        # Published is checked under the lock: the build that held it may just have ended.
        if held is not None and not (model_dir / picked).exists():
            break
        if held is not None:
            _release(lock, held)
        if version is not None and held is None:
            raise VersionBusyError(
                f"version {version} of {name} is being built by another process: wait for it, "
                "or pick another --version"
            )
        if version is not None:
            raise FileExistsError(
                f"{model_dir / version} exists: model versions are immutable, pick another"
            )
        picked = str(int(picked) + 1)
    try:
        yield picked
    finally:
        # Unlinked while held, so no lock file is left behind. A build that opened it before
        # then locks a file no one else can: once this build published, it finds the
        # version (above); after a failed one, a third build of the same version at the same
        # moment could take the number too, and one of them fails at the rename as before.
        _release(lock, held)


def _try_lock(path: Path) -> IO[bytes] | None:
    handle = path.open("ab")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _release(lock: Path, held: IO[bytes]) -> None:
    """Unlinked while held (no lock file left behind), then let go."""
    lock.unlink(missing_ok=True)
    held.close()


def _remove_orphans(model_dir: Path) -> None:
    """Staging folders of builds that are gone: no build holds their version's lock. Judged
    by the lock, not by the process id in the name: a build in another container sharing the
    repository has a pid this one cannot see, and its live folder was removed (a reviewer's
    probe, with a build in another pid namespace)."""
    for path in model_dir.glob(f"{STAGING_PREFIX}*"):
        version = path.name.removeprefix(STAGING_PREFIX).rpartition("-")[0]
        if not is_version(version):
            continue
        lock = model_dir / f".build-{version}.lock"
        held = _try_lock(lock)
        if held is None:
            continue  # a build of that version is running
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            _release(lock, held)
