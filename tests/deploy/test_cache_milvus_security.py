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

from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_service import cache, lookup, run, store, written
from milvus_server import MilvusKind, MilvusServer, Security

from hopline.cache.config import MILVUS_CA_ENV, MILVUS_CERT_ENV, MILVUS_TOKEN_ENV
from hopline.cache.store import CacheStoreError
from hopline.cli.certs import make_certs
from hopline.protos.hopline.common.v1 import common_pb2

SETTINGS = {"milvus_timeout_s": 3.0}


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
