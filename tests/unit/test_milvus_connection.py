"""The cache's Milvus client dialled again when its token or certificate files change
(cache/milvus_connection.py). `dial` stands in for pymilvus.MilvusClient here (it records
the access it was given); a real Milvus standalone whose password is rotated under a running
cache is tests/deploy/test_cache_milvus_security.py (`make milvus-server-tests`)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_connection import MilvusConnection
from hopline.cache.store import CacheStoreError

RECHECK_S = 0.05


class Client:
    def __init__(self, access: MilvusAccess) -> None:
        self.token = access.token
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Dialler:
    def __init__(self) -> None:
        self.clients: list[Client] = []
        self.refuse = False

    def __call__(self, access: MilvusAccess) -> Client:
        if self.refuse:
            raise ConnectionError("the server refused the token")
        self.clients.append(Client(access))
        return self.clients[-1]


def _closed(client: Client) -> bool:
    return client.closed  # read afresh: a narrowed attribute would not be


def _rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    # A later mtime even where the clock's step is coarse: the identity must change.
    later = time.time_ns() + 1_000_000_000
    os.utime(path, ns=(later, later))


def _after_recheck(connection: MilvusConnection) -> Client:
    time.sleep(RECHECK_S * 2)
    client: Client = connection.client
    return client


def _watching(token: Path, dial: Dialler, grace_s: float = 300.0) -> MilvusConnection:
    access = MilvusAccess(token_file=str(token)).reread()
    return MilvusConnection(dial, access, grace_s=grace_s, recheck_s=RECHECK_S)


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("hopline_cache:first-password\n")
    return path


def test_a_rotated_token_is_dialled_with_and_the_old_client_closed_after_its_grace(
    token: Path,
) -> None:
    dial = Dialler()
    connection = _watching(token, dial, grace_s=0.1)
    first = connection.client
    assert first.token == "hopline_cache:first-password"
    assert connection.client is first  # nothing changed: the same client

    _rewrite(token, "hopline_cache:second-password\n")
    second = _after_recheck(connection)
    assert second is not first
    assert second.token == "hopline_cache:second-password"
    assert connection.redials == 1
    assert not first.closed, "a call already on the old client must be able to finish"
    time.sleep(0.3)
    assert _closed(first)
    assert not second.closed
    connection.close()
    assert _closed(second)
    assert connection.client is None


def test_files_that_cannot_be_used_keep_the_client_with_one_warning_a_change(
    token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dial = Dialler()
    connection = _watching(token, dial)
    first = connection.client
    caplog.set_level(logging.WARNING, "hopline.cache.milvus_connection")

    _rewrite(token, "")  # truncated before it is written: the first step of a rewrite
    assert _after_recheck(connection) is first
    assert _after_recheck(connection) is first  # no change since: no second warning
    token.unlink()
    assert _after_recheck(connection) is first
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "is empty" in str(getattr(warnings[0], "reason", ""))
    assert "cannot read" in str(getattr(warnings[1], "reason", ""))
    assert "password" not in caplog.text  # the token is never logged

    _rewrite(token, "hopline_cache:second-password\n")
    assert _after_recheck(connection).token == "hopline_cache:second-password"
    assert not first.closed
    connection.close()
    assert _closed(first), "closing closes the old client still in its grace"


def test_a_dial_the_server_refuses_keeps_the_client_in_use(
    token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dial = Dialler()
    connection = _watching(token, dial)
    first = connection.client
    dial.refuse = True
    _rewrite(token, "hopline_cache:a-password-the-server-has-not-got\n")
    with caplog.at_level(logging.WARNING, "hopline.cache.milvus_connection"):
        assert _after_recheck(connection) is first
    assert "refused the token" in str(getattr(caplog.records[-1], "reason", ""))
    assert connection.redials == 0


def test_a_renewed_certificate_is_dialled_with(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("PEM one\n")
    dial = Dialler()
    connection = MilvusConnection(dial, MilvusAccess(ca=str(ca)).reread(), recheck_s=RECHECK_S)
    first = connection.client
    _rewrite(ca, "PEM two\n")
    assert _after_recheck(connection) is not first
    assert len(dial.clients) == 2


def test_without_files_nothing_is_watched() -> None:
    dial = Dialler()
    connection = MilvusConnection(dial, NO_ACCESS, recheck_s=0.0)
    first = connection.client
    assert connection.client is first
    assert len(dial.clients) == 1


def test_the_first_dial_fails_for_the_caller(token: Path) -> None:
    dial = Dialler()
    dial.refuse = True
    with pytest.raises(ConnectionError):
        MilvusConnection(dial, MilvusAccess(token_file=str(token)).reread())


def test_reread_names_the_setting_whose_file_cannot_be_used(tmp_path: Path) -> None:
    access = MilvusAccess(ca=str(tmp_path / "gone.crt"))
    with pytest.raises(CacheStoreError, match="cannot read HOPLINE_CACHE_MILVUS_CA"):
        access.reread()
