"""The semantic tier searched in memory: the real CacheService (real milvus-lite file, real
encoder, real gRPC server, in this process so its counters and store can be looked at) finds
the same nearest entries in memory as Milvus does, answers semantic hits without a Milvus
search, reads a scope's vectors back after a restart before searching it in memory, and
never returns an invalidated entry or another tenant's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from cache_service import cache, lookup, run, scope, store, written

from hopline.cache.counts import CacheCount
from hopline.cache.keys import normalise_text, scope_tuple
from hopline.cache.semantic_search import SEMANTIC_CANDIDATES
from hopline.cache.service import CacheService
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

SEMANTIC = common_pb2.CACHE_OUTCOME_SEMANTIC
MISS = common_pb2.CACHE_OUTCOME_MISS
STORED = [
    "where is my parcel",
    "how do I reset my password",
    "cancel my subscription please",
    "what is the interest rate on my savings account",
    "my card was stolen",
    "book a table for two tonight",
    "how much is left on my gift card",
    "change the language to french",
]
QUERIES = [
    "where's my package",
    "I forgot my password",
    "please cancel the subscription",
    "someone stole my card",
    "reserve a table for tonight",
    "what's the weather tomorrow",
]


async def store_semantic(stub: object, texts: list[str], tenant: str = "vec") -> None:
    for text in texts:
        await store(stub, text, scope=scope(tenant=tenant), mode="semantic", label=text[:20])
    await written(stub)


async def semantic(stub: object, text: str, tenant: str = "vec") -> cache_pb2.LookupResponse:
    return await lookup(stub, text, scope=scope(tenant=tenant), mode="semantic", threshold=0.7)


async def until(service: CacheService, counter: CacheCount, value: int) -> None:
    deadline = time.monotonic() + 20
    while service.counts[counter] < value:
        assert time.monotonic() < deadline, f"{counter} never reached {value}"
        await asyncio.sleep(0.02)


def test_memory_finds_what_milvus_finds(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            await store_semantic(stub, STORED)
            assert service.embedder is not None
            assert service.index is not None
            sc = scope_tuple(scope(tenant="vec"))
            for i, text in enumerate(QUERIES, 1):
                vector = await service.embedder.embed(normalise_text(text))
                now = time.time()
                memory = await service.semantic.search(vector, sc, now)
                milvus = await service.semantic.milvus.search(vector, sc, now, SEMANTIC_CANDIDATES)
                assert service.counts[CacheCount.MEMORY_SEARCHES] == i
                assert [e.key for e, _ in memory.found] == [e.key for e, _ in milvus.found]
                np.testing.assert_allclose(
                    [s for _, s in memory.found], [s for _, s in milvus.found], atol=1e-4
                )
                assert [e.response for e, _ in memory.found] == [
                    e.response for e, _ in milvus.found
                ]

    run(body)


def test_semantic_hits_come_from_memory_and_leave_with_their_entries(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            await store_semantic(stub, STORED)
            before = {count: service.counts[count] for count in CacheCount}
            hit = await semantic(stub, "someone stole my card")
            assert hit.outcome == SEMANTIC
            assert hit.prediction.label == "my card was stolen"
            # Another tenant's entries are not in its scope's matrix: a miss.
            other = await semantic(stub, "someone stole my card", tenant="vec-other")
            assert other.outcome == MISS
            stats = await stub.GetStats(cache_pb2.GetStatsRequest())
            assert stats.memory_searches == before[CacheCount.MEMORY_SEARCHES] + 2
            assert stats.milvus_searches == before[CacheCount.MILVUS_SEARCHES]

            await stub.Invalidate(cache_pb2.InvalidateRequest(entry_ids=[hit.entry_id]))
            # The nearest left is "how much is left on my gift card", at 0.41: a miss.
            assert (await semantic(stub, "someone stole my card")).outcome == MISS
            await stub.Invalidate(cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant="vec")))
            assert (await semantic(stub, "I forgot my password")).outcome == MISS
            assert service.index is not None
            assert service.index.vectors is not None
            assert len(service.index.vectors) == 0

    run(body)


def test_a_restart_reads_the_vectors_back_before_searching_memory(tmp_path: Path) -> None:
    async def body() -> None:
        db = tmp_path / "cache.db"
        async with cache(db) as (_, stub):
            await store_semantic(stub, STORED)
            first = await semantic(stub, "I forgot my password")
            assert first.outcome == SEMANTIC
        async with cache(db) as (service, stub):
            # The rebuilt index has the entries without their vectors: Milvus answers
            # while the scope's vectors are read back.
            hit = await semantic(stub, "I forgot my password")
            assert (hit.outcome, hit.entry_id) == (SEMANTIC, first.entry_id)
            assert service.counts[CacheCount.MILVUS_SEARCHES] == 1
            await until(service, CacheCount.VECTORS_READ, len(STORED))
            again = await semantic(stub, "I forgot my password")
            assert (again.outcome, again.entry_id) == (SEMANTIC, first.entry_id)
            assert abs(again.similarity - hit.similarity) < 1e-4
            assert service.counts[CacheCount.MEMORY_SEARCHES] == 1
            assert service.counts[CacheCount.MILVUS_SEARCHES] == 1

    run(body)


def test_searches_waiting_together_share_one_product(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every memory search on a worker thread (as for a scope over INLINE_ROWS rows), so the
    ones that arrive while one is running wait and go together."""
    monkeypatch.setattr("hopline.cache.semantic_search.INLINE_ROWS", 0)

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            await store_semantic(stub, STORED)

            def answer(r: cache_pb2.LookupResponse) -> tuple[int, str, float]:
                return (r.outcome, r.prediction.label, round(r.similarity, 4))

            asked = QUERIES * 4
            alone = [answer(await semantic(stub, text)) for text in asked]
            calls = service.semantic.memory.calls
            assert calls == len(asked)
            together = await asyncio.gather(*(semantic(stub, text) for text in asked))
            assert [answer(r) for r in together] == alone
            assert service.semantic.memory.searches == 2 * len(asked)
            assert service.semantic.memory.calls - calls < len(asked)  # some shared a call
            assert service.counts[CacheCount.MILVUS_SEARCHES] == 0
            assert sum(a[0] == SEMANTIC for a in alone) >= len(QUERIES) // 2

    run(body)


def test_switched_off_every_search_goes_to_milvus(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db", semantic_index=False) as (service, stub):
            await store_semantic(stub, STORED[:3])
            assert (await semantic(stub, "please cancel the subscription")).outcome == SEMANTIC
            assert service.counts[CacheCount.MEMORY_SEARCHES] == 0
            assert service.counts[CacheCount.MILVUS_SEARCHES] == 1

    run(body)
