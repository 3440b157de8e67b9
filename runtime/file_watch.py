"""Files a process reads again when they change: API keys (gateway/identity.py) and TLS
certificates (runtime/tls.py), which an operator rotates without a restart.

A file's identity is its inode, size and mtime: an edit changes the last two, a replacement
the inode too, and `os.stat` follows a Kubernetes Secret volume's symlinks to the file the
kubelet swapped in. A file that cannot be read has no identity (None), which is a change too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

FileState = tuple[int, int, int] | None


def file_state(path: str) -> FileState:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class FileWatch:
    """Whether any of `paths` changed since the last look (the first look is at creation),
    looked at no more often than every `every_s` (0: at every call)."""

    def __init__(self, paths: Iterable[str], every_s: float = 0.0) -> None:
        self.paths = tuple(p for p in paths if p)
        self.every_s = every_s
        self._seen = self._states()
        self._next_look = time.monotonic() + every_s

    def _states(self) -> tuple[FileState, ...]:
        return tuple(file_state(p) for p in self.paths)

    def changed(self) -> bool:
        if self.every_s > 0:
            now = time.monotonic()
            if now < self._next_look:
                return False
            self._next_look = now + self.every_s
        states = self._states()
        if states == self._seen:
            return False
        self._seen = states
        return True
