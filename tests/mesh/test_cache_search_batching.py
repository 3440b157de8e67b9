"""Concurrent semantic lookups share Milvus searches and still get the answers they get one
at a time: the real CacheService (real milvus-lite file, real gRPC server, the real MiniLM
encoder) in this process, so its search batcher's counts can be read. Its vectors are not
searched in memory (HOPLINE_CACHE_SEMANTIC_INDEX=false), so every search reaches Milvus."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cache_service import cache, lookup, run, store, written

from hopline.observability import metrics
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

STORED = [
    "how do I reset my password",
    "where is my order",
    "cancel my subscription please",
    "the app crashes when I open it",
    "I was charged twice this month",
    "change the email on my account",
]
ASKED = [
    "I forgot my password, how can I reset it",
    "where's my package",
    "please cancel my subscription",
    "app keeps crashing on start",
    "you billed me two times",
    "update my account email",
    "what is the weather like",
    "how do I reset my pasword",
] * 3


def exported() -> tuple[float, float]:
    """(calls, searches) as /metrics exports them: hopline_cache_search_rows' count and sum."""
    samples = {s.name: s.value for f in metrics.CACHE_SEARCH_ROWS.collect() for s in f.samples}
    return samples["hopline_cache_search_rows_count"], samples["hopline_cache_search_rows_sum"]


def test_concurrent_lookups_share_searches_and_get_their_own_answers(tmp_path: Path) -> None:
    async def main() -> None:
        async with cache(tmp_path / "c.db", semantic_index=False) as (service, stub):
            for text in STORED:
                await store(stub, text, label=text.split()[-1], mode="semantic")
            await written(stub)

            def answer(r: cache_pb2.LookupResponse) -> tuple[int, str, float]:
                return (r.outcome, r.prediction.label, round(r.similarity, 4))

            alone = []
            for text in ASKED:  # one at a time: every search goes alone
                reply = await lookup(stub, text, mode="semantic", threshold=0.7)
                alone.append(answer(reply))
            calls, searches = service.semantic.milvus.calls, service.semantic.milvus.searches
            assert calls == searches == len(ASKED)
            metric_calls, metric_searches = exported()
            together = await asyncio.gather(
                *(lookup(stub, t, mode="semantic", threshold=0.7) for t in ASKED)
            )
            assert [answer(r) for r in together] == alone
            new_calls = service.semantic.milvus.calls - calls
            new_searches = service.semantic.milvus.searches - searches
            assert new_searches == len(ASKED)
            assert new_calls < new_searches  # some searches shared a call
            assert exported() == (metric_calls + new_calls, metric_searches + new_searches)
            hits = [a for a in alone if a[0] == common_pb2.CACHE_OUTCOME_SEMANTIC]
            assert len(hits) >= len(ASKED) // 2  # the paraphrases hit

    run(main)
