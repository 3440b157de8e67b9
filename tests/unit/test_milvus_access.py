"""The cache's settings for a Milvus server that authenticates or encrypts
(cache/milvus_access.py): checked against each other and the URI before anything connects,
each refusal naming the setting to change, and turned into pymilvus' keywords. The server
side, a real Milvus standalone with authentication and TLS, is
tests/deploy/test_cache_milvus_security.py (`make milvus-server-tests`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from hopline.cache.config import (
    MILVUS_CA_ENV,
    MILVUS_CERT_ENV,
    MILVUS_DB_ENV,
    MILVUS_KEY_ENV,
    MILVUS_TOKEN_ENV,
    CacheConfig,
)
from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_store import milvus_reason
from hopline.cache.milvus_user import user_and_password
from hopline.cache.store import CacheStoreError

SERVER = "https://milvus.example:19530"


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("ca.crt", "cache.crt", "cache.key", "token"):
        (tmp_path / name).write_text("root:Milvus\n" if name == "token" else f"PEM {name}\n")
        files[name] = str(tmp_path / name)
    return files


def _config(**settings: str) -> CacheConfig:
    config: CacheConfig = dataclasses.replace(CacheConfig(), **settings)  # type: ignore[arg-type]
    return config


def test_nothing_set_is_no_access_whatever_the_uri() -> None:
    assert MilvusAccess.of(_config()) == NO_ACCESS
    assert MilvusAccess.of(_config(uri=SERVER)).client_kwargs() == {}


def test_a_token_is_read_from_its_file_and_never_shown(pems: dict[str, str]) -> None:
    access = MilvusAccess.of(_config(uri="http://milvus:19530", milvus_token_file=pems["token"]))
    assert access.client_kwargs() == {"token": "root:Milvus"}
    assert "Milvus" not in repr(access).replace("MilvusAccess", "")


def test_a_ca_alone_verifies_the_server_and_a_client_pair_makes_it_mutual(
    pems: dict[str, str],
) -> None:
    one_way = MilvusAccess.of(_config(uri=SERVER, milvus_ca=pems["ca.crt"]))
    assert one_way.client_kwargs() == {"server_pem_path": pems["ca.crt"]}
    mutual = MilvusAccess.of(
        _config(
            uri=SERVER,
            milvus_ca=pems["ca.crt"],
            milvus_client_cert=pems["cache.crt"],
            milvus_client_key=pems["cache.key"],
            milvus_token_file=pems["token"],
        )
    )
    assert mutual.client_kwargs() == {
        "token": "root:Milvus",
        "ca_pem_path": pems["ca.crt"],
        "client_pem_path": pems["cache.crt"],
        "client_key_path": pems["cache.key"],
    }


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"milvus_ca": "ca.crt"},
            f"{MILVUS_CA_ENV} set, but HOPLINE_CACHE_URI '.hopline/cache.db' is a",
        ),
        (
            {"uri": "http://milvus:19530", "milvus_ca": "ca.crt"},
            f"{MILVUS_CA_ENV} set, but HOPLINE_CACHE_URI 'http://milvus:19530' does not "
            "start with https",
        ),
        (
            {"uri": SERVER, "milvus_client_cert": "cache.crt", "milvus_ca": "ca.crt"},
            f"{MILVUS_CERT_ENV} and {MILVUS_KEY_ENV} go together",
        ),
        (
            {"uri": SERVER, "milvus_client_cert": "cache.crt", "milvus_client_key": "cache.key"},
            f"{MILVUS_CERT_ENV} needs {MILVUS_CA_ENV}",
        ),
        ({"uri": SERVER, "milvus_ca": "missing.crt"}, f"cannot read {MILVUS_CA_ENV} '"),
        ({"uri": SERVER, "milvus_token_file": "missing"}, f"cannot read {MILVUS_TOKEN_ENV} '"),
        ({"uri": SERVER, "milvus_token_file": "empty"}, f"{MILVUS_TOKEN_ENV} '"),
        (
            {"milvus_db": "hopline"},
            f"{MILVUS_DB_ENV} set, but HOPLINE_CACHE_URI '.hopline/cache.db' is a",
        ),
        (
            {"uri": SERVER, "milvus_db": "hop-line"},
            f"{MILVUS_DB_ENV} 'hop-line': Milvus takes a letter or underscore",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(
    tmp_path: Path, pems: dict[str, str], settings: dict[str, str], message: str
) -> None:
    (tmp_path / "empty").write_text("\n")
    resolved = {
        key: (
            pems.get(value, str(tmp_path / value))
            if key not in ("uri", "milvus_db") and not value.startswith(".")
            else value
        )
        for key, value in settings.items()
    }
    with pytest.raises(CacheStoreError) as refused:
        MilvusAccess.of(_config(**resolved))
    assert str(refused.value).startswith(message)
    if settings.get("milvus_token_file") == "empty":
        assert str(refused.value).endswith("is empty")


def test_a_database_of_its_own_goes_with_every_client(pems: dict[str, str]) -> None:
    access = MilvusAccess.of(
        _config(uri=SERVER, milvus_token_file=pems["token"], milvus_db="hopline_cache")
    )
    assert access.client_kwargs() == {"token": "root:Milvus", "db_name": "hopline_cache"}


def test_the_start_up_error_says_what_the_server_may_want() -> None:
    assert MilvusAccess().refusal_hint("http://milvus:19530") == (
        f"or it wants a token ({MILVUS_TOKEN_ENV}), "
        f"or it wants TLS (an https:// URI and {MILVUS_CA_ENV})"
    )
    assert MilvusAccess(token="t", ca="ca.crt").refusal_hint(SERVER) == (
        f"or it refused the token in {MILVUS_TOKEN_ENV}, or it refused this client's TLS "
        f"({MILVUS_CA_ENV}, {MILVUS_CERT_ENV})"
    )


@pytest.mark.parametrize(
    ("token", "words"),
    [
        ("an-api-key", "must hold 'user:password'"),
        ("user:", "must hold 'user:password'"),
        ("hopline-cache:secret", "a letter, then letters, digits and underscores"),
        ("9lives:secret", "a letter, then letters, digits and underscores"),
    ],
)
def test_the_cache_user_to_make_is_named_as_milvus_takes_it(token: str, words: str) -> None:
    with pytest.raises(CacheStoreError, match=words):
        user_and_password(token)
    assert user_and_password("hopline_cache:se:cret") == ("hopline_cache", "se:cret")


def test_a_refused_privilege_says_what_grants_it() -> None:
    refused = grpc.aio.AioRpcError(
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "PrivilegeInsert: permission deny to someone",
        None,
    )
    assert milvus_reason(refused) == (
        "PERMISSION_DENIED: PrivilegeInsert: permission deny to someone (the cache's Milvus "
        "user lacks it: `hopline cache milvus-user` grants what the cache needs)"
    )
    gone = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "no answer", None
    )
    assert milvus_reason(gone) == "UNAVAILABLE: no answer"
    assert milvus_reason(ValueError("a  plain\n error")) == "a plain error"


def test_a_missing_database_says_what_makes_it() -> None:
    import pymilvus

    missing = pymilvus.MilvusException(code=800, message="database not found[database=hop]")
    assert milvus_reason(missing) == (
        f"database not found[database=hop] ({MILVUS_DB_ENV}: `hopline cache milvus-user` makes it)"
    )
    other = pymilvus.MilvusException(code=1, message="something else")
    assert milvus_reason(other) == "something else"
