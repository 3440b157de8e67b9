"""The cache service refuses to start, quickly and with a message that says what to fix,
when its Milvus cannot be used. Each case runs the real `hopline serve cache` process."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cache_service import cache, lookup, run, serve_cache, store, store_batch, written

from harness import Mesh, free_port
from hopline.cache.embedder import embedding_model
from hopline.model.build import default_weights_dir
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2


def test_wrong_vector_dimension_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"
    collection = embedding_model(default_weights_dir()).collection
    # Another writer's collection under our name, with 8-d vectors; written by a child process
    # because milvus-lite allows one process per file. Opened as the store opens it
    # (`milvus_lite.connect`): a bare client fails at once if the server binds late (it did in CI).
    script = f"""
        import warnings
        warnings.simplefilter("ignore")
        from pathlib import Path
        import pymilvus
        from hopline.cache import milvus_lite
        c = milvus_lite.connect(pymilvus, {str(db)!r}, timeout_s=5.0)
        c.create_collection({collection!r}, dimension=8, metric_type="COSINE")
        c.close()
        milvus_lite.stop_server(Path({str(db)!r}))
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=120)
    code, log, _ = serve_cache(str(db))
    assert code != 0
    assert "8-d vectors but the embedder makes 384-d" in log or "lacks fields" in log, log


def test_corrupted_database_file_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"
    db.write_bytes(os.urandom(64 * 1024))
    code, log, took = serve_cache(str(db))
    assert code != 0
    assert "is not a milvus-lite database" in log, log
    assert took < 60


def test_milvus_server_that_does_not_answer_fails_fast(tmp_path: Path) -> None:
    """Nothing listening says so: it said "no Milvus answered within 3s" for a refused port
    that failed at once, as for a server that never answered."""
    port = free_port()
    code, log, took = serve_cache(f"http://127.0.0.1:{port}")
    assert code != 0
    assert f"nothing answers at 127.0.0.1:{port} (Connection refused)" in log, log
    assert took < 45, f"start-up took {took:.0f}s: it must fail, not hang"
    with socket.socket() as silent:  # listens, never speaks gRPC
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        code, log, _ = serve_cache(f"http://127.0.0.1:{silent.getsockname()[1]}")
    assert code != 0
    assert "but did not answer as Milvus within 3s" in log, log


def test_second_process_on_the_same_file_is_refused(tmp_path: Path) -> None:
    # A milvus-lite file in every lane (HOPLINE_TEST_MILVUS): the file's lock is the subject.
    first = Mesh(tmp_path / "unused-repo", tmp_path, HOPLINE_CACHE_URI=str(tmp_path / "cache.db"))
    first.start(("cache",))
    try:
        code, log, _ = serve_cache(first.env["HOPLINE_CACHE_URI"])
        assert code != 0
        assert "another process holds it" in log, log
        # The refused start must leave the first one's hold in place: milvus-lite's refused
        # server object removed the lock file on its way out, and a third start then took a
        # new one and served the same file beside the first (a durability probe).
        try:
            code, log, _ = serve_cache(first.env["HOPLINE_CACHE_URI"], timeout_s=45)
        except subprocess.TimeoutExpired:
            pytest.fail("a third cache opened and served the file the first still writes")
        assert code != 0
        assert "another process holds it" in log, log
    finally:
        first.stop()


@pytest.mark.parametrize("bad", ["/dev/null", "."])
def test_paths_that_are_not_database_files(tmp_path: Path, bad: str) -> None:
    uri = bad if bad.startswith("/") else str(tmp_path)
    code, log, _ = serve_cache(uri)
    assert code != 0
    assert "not a milvus-lite database" in log, log


def test_a_collection_left_without_its_index_is_indexed_and_served(tmp_path: Path) -> None:
    """Milvus creates a collection and its index in two steps; a start stopped between them
    (killed, past its deadline, its user refused CreateIndex) left a collection no later start
    could open: `describe_index` answers None there, and the cache failed on it. Made here by
    dropping the index of a collection the store created, in a child process (milvus-lite
    takes one process per file)."""
    db = tmp_path / "cache.db"
    model = embedding_model(default_weights_dir())
    script = f"""
        import warnings
        warnings.simplefilter("ignore")
        from hopline.cache.milvus_store import MilvusStore
        store = MilvusStore({str(db)!r}, {model.collection!r}, {model.dim})
        store._client.release_collection({model.collection!r})
        store._client.drop_index({model.collection!r}, "vector")
        assert store._client.describe_index({model.collection!r}, "vector") is None
        store.close()
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=120)

    async def body() -> None:
        async with cache(db) as (_, stub):
            await store(stub, "where is my parcel")
            await written(stub)
            reply = await lookup(stub, "where is my parcel", mode="exact")
            assert reply.outcome == common_pb2.CACHE_OUTCOME_EXACT

    run(body)


def test_a_load_past_its_bound_fails_with_the_setting_to_raise(tmp_path: Path) -> None:
    """Loading a collection into Milvus's memory grows with its rows (66 s for 1,000,000 on
    milvus-lite, 2 cores), so it has its own bound, HOPLINE_CACHE_LOAD_TIMEOUT_S, not a
    call's. A load past it ends the start with a message naming the setting and the rows
    (here 4,000 rows against a 10 ms bound), and leaves the file for the next start: the
    same file then opens with the default bound and holds every row."""
    db = tmp_path / "cache.db"
    model = embedding_model(default_weights_dir())
    script = f"""
        import time, warnings
        warnings.simplefilter("ignore")
        import numpy as np
        from hopline.cache.keys import digest
        from hopline.cache.milvus_store import MilvusStore
        from hopline.cache.store import Entry
        store = MilvusStore({str(db)!r}, {model.collection!r}, {model.dim})
        now, vector = time.time(), np.ones({model.dim}, dtype=np.float32)
        scope = ("t", "m", "1", "{{}}")
        rows = [(Entry(digest(str(i)), scope, "text", b"x", now, now + 3600), vector)
                for i in range(4000)]
        store.upsert(rows)
        store.close()
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=120)
    code, log, _ = serve_cache(str(db), env={"HOPLINE_CACHE_LOAD_TIMEOUT_S": "0.01"})
    assert code != 0
    assert "did not load the 4000 rows" in log, log
    assert "within 0.01 s (HOPLINE_CACHE_LOAD_TIMEOUT_S)" in log, log

    async def body() -> None:
        async with cache(db) as (_, stub):
            stats = await stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.entries == 4000

    run(body)


def test_a_file_damaged_past_its_header_is_refused(tmp_path: Path) -> None:
    """Random bytes over the second half of a file's pages, its header whole: milvus-lite
    loads it all the same and the cache served, its new entries lost at the next start (a
    cache probe: 30 stores acknowledged, 0 held). Counting its rows fails: the start does."""
    db = tmp_path / "cache.db"

    async def fill() -> None:
        async with cache(db) as (_, stub):
            await stub.StoreBatch(store_batch("damaged", range(300)), timeout=60)
            await written(stub)

    run(fill)
    pages = db.stat().st_size // 4096
    with db.open("r+b") as f:
        f.seek(pages // 2 * 4096)
        f.write(random.Random(7).randbytes((pages - pages // 2 - 1) * 4096))
    code, log, _ = serve_cache(str(db))
    assert code != 0
    assert "the file looks damaged" in log, log


def test_the_files_a_cache_makes_are_its_users_alone(tmp_path: Path) -> None:
    """The cache's files hold every tenant's texts and answers; made with the umask's 022,
    the milvus-lite file, its logs and the verified-hit evidence were world-readable, and
    `strings` on the file listed each tenant's texts to any user of the host (a security
    probe). The folders the cache makes are 0700, its files 0600 (cache/private_files.py)."""
    db = tmp_path / "state" / "deeper" / "cache.db"
    umask = os.umask(0o022)
    try:

        async def body() -> None:
            async with cache(db) as (_, stub):
                await store(stub, "i was charged twice for my order")
                await written(stub)

        run(body)
    finally:
        os.umask(umask)
    made = [tmp_path / "state", tmp_path / "state" / "deeper", db, Path(f"{db}.logs")]
    verify = db.with_name("cache.verify.sqlite")
    assert verify.exists()  # the verified-hit evidence, beside the file
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [*made, verify]}
    assert modes == {
        "state": "0o700",
        "deeper": "0o700",
        "cache.db": "0o600",
        "cache.db.logs": "0o700",
        "cache.verify.sqlite": "0o600",
    }
