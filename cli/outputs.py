"""Output paths checked before a command's work: a long run (`hopline bench`, `make bench`'s
suite, a soak, a calibration) that could not write its results ended after the whole run in a
traceback, with nothing written (`bench --json /root-owned/x.json` after 37 minutes)."""

from __future__ import annotations

import os
from pathlib import Path


def output_problem(path: Path, flag: str, *, directory: bool = False) -> str | None:
    """What stops `path` (named by `flag`) from being written, or None. The folder it goes in
    is made here, as the writers would make it; a file is not created before the run."""
    if directory:
        if path.exists() and not path.is_dir():
            return f"{flag} {path}: is a file; it names a directory to write into"
        folder = path
    else:
        if path.is_dir():
            return f"{flag} {path}: is a directory; it names the file to write"
        folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{flag} {path}: cannot create {folder}: {exc.strerror or exc}"
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        return f"{flag} {path}: {target} is not writable"
    return None


def output_problems(*outputs: tuple[Path | None, str]) -> list[str]:
    """The problems of each (file path or None, flag) given."""
    return [p for path, flag in outputs if path is not None and (p := output_problem(path, flag))]
