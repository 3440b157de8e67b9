"""The cache's files hold every tenant's texts and answers: readable by this process's user
only, as a database's are. Created with the process's umask (022), the milvus-lite file, its
logs and the verified-hit evidence were world-readable, and `strings` on the file listed
each tenant's texts to any user of the host (a security probe).

A folder the cache makes is made 0700; a file it opens is set 0600 (a folder of logs 0700).
A folder the operator made (a volume's mount) keeps its mode: what is in it is still
private. A mode that cannot be set (another owner, a read-only mount) is left as it is: the
file is usable, and who may read it is then the operator's choice.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600


def private_folder(path: Path) -> None:
    """`path` and the folders above it that do not exist yet, made owner-only."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        at = at.parent
    path.mkdir(parents=True, exist_ok=True)
    for folder in missing:
        keep_private(folder)


def keep_private(path: Path) -> None:
    """`path` (a file, or a folder of the cache's own) readable by its owner only."""
    with contextlib.suppress(OSError):
        mode = FOLDER_MODE if stat.S_ISDIR(os.stat(path).st_mode) else FILE_MODE
        os.chmod(path, mode)
