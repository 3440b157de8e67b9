"""The model repository's memo of file digests (model/repository.py:_file_digest): a file
whose stat is unchanged is not read again, and past the memo's bound the least recently used
digest goes, not the first one made."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from hopline.model import repository


def test_the_least_recently_used_digest_goes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(repository, "_FILE_DIGESTS", type(repository._FILE_DIGESTS)())
    monkeypatch.setattr(repository, "_FILE_DIGESTS_KEPT", 3)
    files = []
    for name in "abcd":
        path = tmp_path / name
        path.write_bytes(name.encode() * 1000)
        files.append(path)
    a, b, c, d = files
    for path in (a, b, c):
        assert repository._file_digest(path) == hashlib.sha256(path.read_bytes()).digest()
    repository._file_digest(a)  # used again: now the most recent
    repository._file_digest(d)  # one past the bound: b, used longest ago, goes
    held = {key[0] for key in repository._FILE_DIGESTS}
    assert held == {str(a), str(c), str(d)}
    hashed = []

    class Counting:
        @staticmethod
        def sha256() -> hashlib._Hash:
            hashed.append(1)
            return hashlib.sha256()

    monkeypatch.setattr(repository, "hashlib", Counting)
    assert repository._file_digest(a) == hashlib.sha256(a.read_bytes()).digest()
    assert hashed == []  # memoised: not read and hashed again
    repository._file_digest(b)  # gone from the memo: hashed again
    assert hashed == [1]
