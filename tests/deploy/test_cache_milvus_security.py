"""The cache over a Milvus server that authenticates and serves TLS, as a production Milvus
does: a real Milvus standalone (the PyPI `milvus` 2.3.5 server, `make milvus-standalone`)
with `common.security.authorizationEnabled` and `tlsMode` 1 (the server verified by a CA) or
2 (mutual TLS), certificates from cli/certs.py. A real CacheService and gRPC server in this
process (tests/cache_service.py): stores reach Milvus over TLS with the token, a restarted
cache rebuilds its index from them, and a cache without the token, with a wrong one, in
plaintext or with a CA that did not sign the server fails its start naming what to set.

Run by `make milvus-server-tests` only (tests/deploy is outside the default lanes): it needs
the standalone, which that target installs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pymilvus
import pytest
from cache_service import cache, lookup, run, scope, store, written
from milvus_server import MilvusKind, MilvusServer, Security

from hopline.cache.config import (
    MILVUS_CA_ENV,
    MILVUS_CERT_ENV,
    MILVUS_DB_ENV,
    MILVUS_KEY_ENV,
    MILVUS_TOKEN_ENV,
)
from hopline.cache.counts import CacheCount
from hopline.cache.milvus_user import PRIVILEGES, ROLE
from hopline.cache.store import CacheStoreError
from hopline.cli.certs import make_certs
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

SETTINGS = {"milvus_timeout_s": 3.0}
ERROR_COUNTS = (CacheCount.STORE_ERRORS, CacheCount.WRITE_RETRIES)


@pytest.fixture(params=[False, True], ids=["tls", "mutual_tls"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MilvusServer]:
    certs = make_certs(tmp_path / "certs", roles=("milvus", "cache"))
    security = Security(certs, mutual=request.param)
    milvus = MilvusServer(tmp_path / "milvus", MilvusKind.STANDALONE, security).start()
    try:
        yield milvus
    finally:
        milvus.stop()


def test_stores_reach_milvus_with_the_token_over_tls(server: MilvusServer) -> None:
    assert server.security is not None
    access = server.security.cache_settings()

    async def body() -> None:
        async with cache(server.uri, **SETTINGS, **access) as (_, stub):
            await store(stub, "where is my parcel")
            await written(stub)
        # A new cache's index is rebuilt from what Milvus holds: read over TLS too.
        async with cache(server.uri, **SETTINGS, **access) as (service, stub):
            assert service.peers is not None  # the shared invalidation log: the same access
            reply = await lookup(stub, "where is my parcel", mode="exact")
            assert reply.outcome == common_pb2.CACHE_OUTCOME_EXACT
            assert reply.prediction.label == "order_status"

    run(body)


def _start_fails(uri: str, **settings: object) -> str:
    async def body() -> None:
        async with cache(uri, **SETTINGS, **settings):
            pass

    with pytest.raises(CacheStoreError) as refused:
        run(body)
    return str(refused.value)


def test_a_cache_the_server_refuses_says_what_to_set(server: MilvusServer) -> None:
    assert server.security is not None
    access = server.security.cache_settings()
    no_token = {k: v for k, v in access.items() if k != "milvus_token_file"}
    assert f"or it wants a token ({MILVUS_TOKEN_ENV})" in _start_fails(server.uri, **no_token)

    wrong = Path(access["milvus_token_file"]).with_name("wrong-token")
    wrong.write_text("root:not-the-password\n")
    message = _start_fails(server.uri, **{**access, "milvus_token_file": str(wrong)})
    assert f"or it refused the token in {MILVUS_TOKEN_ENV}" in message

    # A CA that did not sign the server's certificate: the handshake fails.
    stranger = make_certs(Path(access["milvus_ca"]).parent.parent / "stranger", roles=())
    message = _start_fails(server.uri, **{**access, "milvus_ca": str(stranger / "ca.crt")})
    assert f"or it refused this client's TLS ({MILVUS_CA_ENV}, {MILVUS_CERT_ENV})" in message

    plaintext = server.uri.replace("https://", "http://")
    message = _start_fails(plaintext, milvus_token_file=access["milvus_token_file"])
    assert f"or it wants TLS (an https:// URI and {MILVUS_CA_ENV})" in message


def _milvus_user(
    server: MilvusServer, token_file: Path, admin_token_file: str, db: str = ""
) -> subprocess.CompletedProcess[str]:
    """`hopline cache milvus-user` as an operator runs it: the cache's settings by environment."""
    assert server.security is not None
    access = server.security.cache_settings()
    env = {
        **os.environ,
        "HOPLINE_CACHE_URI": server.uri,
        MILVUS_TOKEN_ENV: str(token_file),
        MILVUS_CA_ENV: access["milvus_ca"],
    }
    if db:
        env[MILVUS_DB_ENV] = db
    if "milvus_client_cert" in access:
        env |= {
            MILVUS_CERT_ENV: access["milvus_client_cert"],
            MILVUS_KEY_ENV: access["milvus_client_key"],
        }
    command = [sys.executable, "-m", "hopline", "cache", "milvus-user"]
    done = subprocess.run(
        [*command, "--admin-token-file", admin_token_file],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done


def test_the_cache_runs_as_a_user_with_only_its_privileges(
    server: MilvusServer, tmp_path: Path
) -> None:
    """The user `hopline cache milvus-user` makes is enough for all the cache does here
    (stores, an overwrite, a restart's rebuild, an exact hit, an invalidation) and cannot
    manage users; a second run changes nothing and says so."""
    assert server.security is not None
    access = server.security.cache_settings()
    token = tmp_path / "cache-user-token"
    token.write_text("hopline_cache:a-password-of-its-own\n")
    wrong = tmp_path / "not-the-admin"
    wrong.write_text("root:not-the-password\n")
    refused = _milvus_user(server, token, str(wrong))
    assert refused.returncode == 1
    assert "error: cannot open Milvus" in refused.stderr
    assert "Traceback" not in refused.stderr
    made = _milvus_user(server, token, access["milvus_token_file"])
    assert made.returncode == 0, made.stderr
    assert "user hopline_cache created" in made.stdout
    again = _milvus_user(server, token, access["milvus_token_file"])
    assert again.returncode == 0, again.stderr
    assert "user hopline_cache exists" in again.stdout

    own = {**access, "milvus_token_file": str(token)}

    async def body() -> None:
        async with cache(server.uri, **SETTINGS, **own) as (_, stub):
            await store(stub, "where is my parcel", label="refund")
            await store(stub, "where is my parcel")  # the same entry, written again
            await store(stub, "cancel my subscription", label="cancel", mode="semantic")
            await written(stub)
        async with cache(server.uri, **SETTINGS, **own) as (service, stub):
            reply = await lookup(stub, "where is my parcel", mode="exact")
            assert reply.outcome == common_pb2.CACHE_OUTCOME_EXACT
            assert reply.prediction.label == "order_status"
            # Semantic lookups search Milvus itself (the in-memory vectors are milvus-lite's).
            near = await lookup(
                stub, "please cancel my subscription", mode="semantic", threshold=0.8
            )
            assert near.outcome in (
                common_pb2.CACHE_OUTCOME_SEMANTIC,
                common_pb2.CACHE_OUTCOME_MISS,
            )
            assert service.counts[CacheCount.MILVUS_SEARCHES] >= 1
            # Invalidate matches tenant, model and version only (parameters would be refused).
            version = common_pb2.Scope(
                tenant=scope().tenant, model=scope().model, model_version="1"
            )
            removed = await stub.Invalidate(cache_pb2.InvalidateRequest(scope=version), timeout=10)
            assert removed.removed == 2
            assert not {c: service.counts[c] for c in ERROR_COUNTS if service.counts[c]}

    run(body)

    # Neither can it manage users, nor even read its own role's grants.
    kwargs = {**server.security.client_kwargs(), "token": "hopline_cache:a-password-of-its-own"}
    client = pymilvus.MilvusClient(server.uri, dedicated=True, **kwargs)
    try:
        # pymilvus passes these refusals on as gRPC's own error.
        with pytest.raises((pymilvus.MilvusException, grpc.RpcError), match="permission deny"):
            client.create_user("intruder", "a-password-123")
        with pytest.raises((pymilvus.MilvusException, grpc.RpcError), match="permission deny"):
            client.describe_role(ROLE)
    finally:
        client.close()
    root = pymilvus.MilvusClient(server.uri, dedicated=True, **server.security.client_kwargs())
    try:
        granted = root.describe_role(ROLE)
        root.create_user("bare_user", "a-password-456")  # a user with no role at all
    finally:
        root.close()
    assert {p["privilege"] for p in granted["privileges"]} == {name for _, name in PRIVILEGES}

    # A user without the cache's privileges (the collections exist by now, so loading them is
    # the first thing it is refused): the start fails naming the privilege, and what grants it.
    bare = tmp_path / "bare-user-token"
    bare.write_text("bare_user:a-password-456\n")
    message = _start_fails(server.uri, **{**access, "milvus_token_file": str(bare)})
    assert "PERMISSION_DENIED: PrivilegeLoad: permission deny to bare_user" in message
    assert "`hopline cache milvus-user` grants what the cache needs" in message


def test_a_password_rotated_on_the_server_is_taken_up_from_the_token_file(
    server: MilvusServer, tmp_path: Path
) -> None:
    """An operator rotates the cache user's password: on the server, then in the Secret the
    cache's token file comes from. The running cache's stores fail while it still presents
    the old password, and reach Milvus once the file holds the new one, without a restart
    (cache/milvus_connection.py); a cache started afterwards finds every entry."""
    assert server.security is not None
    access = server.security.cache_settings()
    token = tmp_path / "cache-user-token"
    token.write_text("hopline_cache:the-first-password\n")
    made = _milvus_user(server, token, access["milvus_token_file"])
    assert made.returncode == 0, made.stderr
    own = {**access, "milvus_token_file": str(token)}
    root = pymilvus.MilvusClient(server.uri, dedicated=True, **server.security.client_kwargs())

    async def body() -> None:
        async with cache(server.uri, **SETTINGS, **own) as (service, stub):
            await store(stub, "where is my parcel")
            await written(stub)
            root.update_password("hopline_cache", "the-first-password", "the-second-password")
            # The old password is refused from now on: a store is refused at once where it
            # reads Milvus first, else acknowledged and its write retried.
            refused = await _try_store(stub, "cancel my subscription")
            if refused is not None:
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
                assert "UNAUTHENTICATED" in str(refused.details())
            deadline = time.monotonic() + 30
            while refused is None and not service.counts[CacheCount.WRITE_RETRIES]:
                assert time.monotonic() < deadline, "a write with the old password went through"
                await asyncio.sleep(0.05)
            token.write_text("hopline_cache:the-second-password\n")
            # The file is looked at every 2 s; without that, never.
            deadline = time.monotonic() + 20
            while pending := await _pending_writes(stub):
                assert time.monotonic() < deadline, f"the new password is not used: {pending}"
                await asyncio.sleep(0.2)
            assert refused is None or not await _try_store(stub, "cancel my subscription")
            await written(stub)
        async with cache(server.uri, **SETTINGS, **own) as (_, stub):
            for text in ("where is my parcel", "cancel my subscription"):
                reply = await lookup(stub, text, mode="exact")
                assert reply.outcome == common_pb2.CACHE_OUTCOME_EXACT, text

    try:
        run(body)
    finally:
        root.close()


async def _try_store(stub: object, text: str, **kw: str) -> grpc.aio.AioRpcError | None:
    try:
        await store(stub, text, **kw)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


async def _pending_writes(stub: Any) -> int | str:
    """Stores not yet in Milvus, or why the cache could not say (it asks Milvus)."""
    try:
        stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return str(exc.details())
    return int(stats.pending_writes)


def test_a_cache_in_a_database_of_its_own_reaches_nothing_outside_it(
    server: MilvusServer, tmp_path: Path
) -> None:
    """HOPLINE_CACHE_MILVUS_DB: `hopline cache milvus-user` makes the database and grants the
    cache's privileges in it alone. The cache works there; another database's collection (one
    root made in the default database) it can neither read nor load, and it cannot make a
    collection outside its own."""
    assert server.security is not None
    access = server.security.cache_settings()
    root = pymilvus.MilvusClient(server.uri, dedicated=True, **server.security.client_kwargs())
    try:
        root.create_collection("payroll", dimension=4)
        root.insert("payroll", [{"id": 1, "vector": [0.1, 0.2, 0.3, 0.4]}])
    finally:
        root.close()
    # Before the database exists, a cache pointed at it is refused naming it.
    message = _start_fails(server.uri, **{**access, "milvus_db": "hopline_missing"})
    assert "database not found[database=hopline_missing]" in message
    assert f"({MILVUS_DB_ENV}: `hopline cache milvus-user` makes it)" in message

    token = tmp_path / "cache-user-token"
    token.write_text("hopline_cache_db:a-password-of-its-own\n")
    made = _milvus_user(server, token, access["milvus_token_file"], db="hopline")
    assert made.returncode == 0, made.stderr
    assert "database hopline created" in made.stdout
    assert "in database hopline" in made.stdout
    again = _milvus_user(server, token, access["milvus_token_file"], db="hopline")
    assert "database hopline exists" in again.stdout

    own = {**access, "milvus_token_file": str(token), "milvus_db": "hopline"}

    async def body() -> None:
        async with cache(server.uri, **SETTINGS, **own) as (_, stub):
            await store(stub, "where is my parcel")
            await written(stub)
        async with cache(server.uri, **SETTINGS, **own) as (service, stub):
            reply = await lookup(stub, "where is my parcel", mode="exact")
            assert reply.outcome == common_pb2.CACHE_OUTCOME_EXACT
            assert not {c: service.counts[c] for c in ERROR_COUNTS if service.counts[c]}

    run(body)

    kwargs = {**server.security.client_kwargs(), "token": "hopline_cache_db:a-password-of-its-own"}
    outside = pymilvus.MilvusClient(server.uri, dedicated=True, **kwargs)
    try:
        refused = (pymilvus.MilvusException, grpc.RpcError)
        with pytest.raises(refused, match="permission deny"):
            outside.query("payroll", filter="id >= 0", output_fields=["id"])
        with pytest.raises(refused, match="permission deny"):
            outside.load_collection("payroll")
        with pytest.raises(refused, match="permission deny"):
            outside.create_collection("squatter", dimension=4)
    finally:
        outside.close()
