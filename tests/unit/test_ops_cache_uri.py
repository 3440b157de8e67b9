"""HOPLINE_CACHE_URI and HOPLINE_CACHE_DIR are refused at the cache's start, naming the
setting, before anything is made or dialled. Left to pymilvus and milvus-lite, `milvus:19530`
(no scheme) failed with a long pymilvus message and left a `milvus:19530.logs` folder in the
working directory, an empty URI said ". is not a milvus-lite database file", one with a space
after it "no Milvus answered within 5s"; and a folder the encoder could not be built in was a
bare FileNotFoundError once Milvus had loaded."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from hopline.cache.config import CacheConfig
from hopline.cache.milvus_access import (
    NO_ACCESS,
    URI_FORMS,
    MilvusAccess,
    home_problem,
    uri_problem,
    work_dir_problem,
)
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.store import CacheStoreError
from hopline.observability.logs import without_passwords

REFUSED = {
    "milvus:19530": f"HOPLINE_CACHE_URI 'milvus:19530' is not a milvus-lite database file "
    f"nor a URI: set {URI_FORMS}",
    "": f"HOPLINE_CACHE_URI is empty: set {URI_FORMS}",
    "  ": f"HOPLINE_CACHE_URI is empty: set {URI_FORMS}",
    "http://milvus:19530 ": "HOPLINE_CACHE_URI 'http://milvus:19530 ' has whitespace around "
    "it: remove it",
    " cache.db": "HOPLINE_CACHE_URI ' cache.db' has whitespace around it: remove it",
    "grpc://milvus:19530": "HOPLINE_CACHE_URI 'grpc://milvus:19530': a Milvus server's URI "
    "starts http://, https://, tcp:// or unix://",
    "http://milvus:99999": "HOPLINE_CACHE_URI 'http://milvus:99999': the port must be a "
    "number from 0 to 65535",
    "http://milvus:port": "HOPLINE_CACHE_URI 'http://milvus:port': the port must be a number "
    "from 0 to 65535",
    "http://:19530": "HOPLINE_CACHE_URI 'http://:19530': a Milvus server's URI names its host "
    "(http://host:port)",
    "unix://": "HOPLINE_CACHE_URI 'unix://': unix:///PATH names the server's socket",
}


@pytest.mark.parametrize("uri", REFUSED)
def test_a_uri_pymilvus_cannot_use_is_refused_naming_the_setting(uri: str) -> None:
    assert uri_problem(uri) == REFUSED[uri]


@pytest.mark.parametrize(
    "uri",
    [
        ".hopline/cache.db",
        "/var/lib/hopline/cache.db",
        "http://milvus:19530",
        "https://milvus",  # pymilvus dials 443
        "HTTPS://milvus:19530",
        "http://milvus:19530/hopline",  # the database, as pymilvus reads the path
        "http://[::1]:19530",
        "tcp://127.0.0.1:19530",
        "unix:///tmp/milvus.sock",
    ],
)
def test_the_uris_pymilvus_takes_are_no_problem(uri: str) -> None:
    assert uri_problem(uri) is None


def _config(**settings: str) -> CacheConfig:
    config: CacheConfig = dataclasses.replace(CacheConfig(), **settings)  # type: ignore[arg-type]
    return config


def test_the_start_refuses_a_uri_without_a_scheme_before_the_milvus_settings(
    tmp_path: Path,
) -> None:
    """MilvusAccess.of is the cache's first step at start: a URI without a scheme is said as
    such, not as a "milvus-lite file" that takes no token."""
    with pytest.raises(CacheStoreError) as refused:
        MilvusAccess.of(_config(uri="milvus:19530", milvus_token_file=str(tmp_path / "t")))
    assert str(refused.value) == REFUSED["milvus:19530"]
    assert MilvusAccess.of(_config(uri=str(tmp_path / "cache.db"))) == NO_ACCESS


def test_a_store_refuses_a_uri_without_a_scheme_and_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for uri in ("milvus:19530", ""):
        with pytest.raises(CacheStoreError) as refused:
            MilvusStore(uri, "c", 4, timeout_s=0.5, start_timeout_s=2.0)
        assert str(refused.value) == REFUSED[uri]
    assert list(tmp_path.iterdir()) == []  # no milvus:19530.logs, no milvus-lite server


def test_a_work_dir_the_encoder_cannot_be_built_in_is_refused_at_start(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "absent")
    cases = {
        str(file): f"HOPLINE_CACHE_DIR {str(file)!r} is not a folder",
        str(dangling): f"HOPLINE_CACHE_DIR {str(dangling)!r} is not a folder",
        str(file / "a" / "b"): f"HOPLINE_CACHE_DIR {str(file / 'a' / 'b')!r} cannot be made: "
        f"{file} is not a folder",
    }
    for work_dir, problem in cases.items():
        assert work_dir_problem(work_dir) == problem
        with pytest.raises(CacheStoreError) as refused:
            MilvusAccess.of(_config(uri=str(tmp_path / "cache.db"), work_dir=work_dir))
        assert str(refused.value) == problem
    for fine in (str(tmp_path), str(tmp_path / "new" / "deeper")):
        assert work_dir_problem(fine) is None
    # Empty is Path(""), the working folder: refused (a settings probe), "." said on purpose not.
    assert work_dir_problem("") == (
        "HOPLINE_CACHE_DIR is empty: give the folder for the built embedding encoder"
    )
    assert work_dir_problem(".") is None
    assert not (tmp_path / "new").exists()  # only checked: the embedder makes it


def test_a_password_in_the_uri_is_refused_and_never_shown() -> None:
    """A security probe: HOPLINE_CACHE_URI='http://admin:S3cretPW@host:19530' was logged
    whole, in the start-up "config" line and in "cannot open Milvus at ...". It is refused
    for the token file, saying so without the password, and the config line masks it."""
    uri = "http://admin:S3cretPW@127.0.0.1:19530"
    said = uri_problem(uri)
    assert said is not None
    assert "S3cretPW" not in said
    assert "http://admin:***@127.0.0.1:19530" in said
    assert "HOPLINE_CACHE_MILVUS_TOKEN_FILE" in said
    config = {"uri": uri, "collection": "c", "flush_ms": 5}
    assert without_passwords(config) == {
        "uri": "http://admin:***@127.0.0.1:19530",
        "collection": "c",
        "flush_ms": 5,
    }
    assert without_passwords("http://user@host:1 /a/b.db tcp://h:2") == (
        "http://user@host:1 /a/b.db tcp://h:2"
    )
    # A password may hold / or @ unescaped: it was logged whole, or after its first @, and the
    # URI refused for its "port" (a reviewer's probe). A path holding @ is no password.
    for secret in ("Ab/cd+ef", "p@ss"):
        uri = f"http://root:{secret}@127.0.0.1:19530"
        said = uri_problem(uri)
        assert said is not None
        assert "carries a password" in said
        assert secret not in said
        assert without_passwords(uri) == "http://root:***@127.0.0.1:19530"
    assert uri_problem("http://milvus:19530/a@b") is None
    assert without_passwords("http://milvus:19530/a@b") == "http://milvus:19530/a@b"


def test_milvus_lite_needs_a_writable_home_said_before_it_starts(tmp_path: Path) -> None:
    """milvus-lite keeps its files under $HOME/.cache: with HOME unwritable the start failed
    with 'Assert "init_flag_ == true" => Mmap manager has not been init' (a deploy probe,
    uid 10001 with HOME not writable). Said first, naming HOME; a server URI needs none. (A
    HOME that is a file stands for one that cannot be written: root writes any folder.)"""
    db = str(tmp_path / "cache.db")
    not_a_folder = tmp_path / "home"
    not_a_folder.write_text("")
    said = home_problem(db, {"HOME": str(not_a_folder)})
    assert said is not None
    assert f"HOME={str(not_a_folder)!r} cannot be written" in said
    assert home_problem("http://milvus:19530", {"HOME": str(not_a_folder)}) is None
    assert home_problem(db, {"HOME": str(tmp_path)}) is None
    # milvus-lite's server reads HOME with no fallback and aborts where it is unset.
    said = home_problem(db, {})
    assert said is not None
    assert "HOME is not set" in said
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # not root: a folder without write permission
        assert home_problem(db, {"HOME": str(locked)}) is not None
