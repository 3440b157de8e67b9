"""The cache's StoreBatch and its key listing, on the real CacheService (real milvus-lite
file, real gRPC server, in this process): each store in a batch is accepted or refused on its
own, as Store would; the watch stream that asks for keys lists what the cache holds, then each
store and each drop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from cache_service import cache, lookup, run, scope, store, written

from hopline.cache.config import ExactFallback
from hopline.cache.counts import CacheCount
from hopline.cache.keys import exact_key, scope_tuple
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

EXACT = common_pb2.CACHE_OUTCOME_EXACT


def request(text: str, label: str = "order_status", **kw: str) -> cache_pb2.StoreRequest:
    return cache_pb2.StoreRequest(
        scope=scope(),
        text=text,
        prediction=common_pb2.Prediction(label=label, score=0.9),
        mode=kw.get("mode", "exact"),
    )


def test_each_store_in_a_batch_is_accepted_or_refused_on_its_own(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (_, stub):
            batch = [
                request("where is my parcel"),
                request("no label here", label=""),
                request("reset my password", mode="semantic"),
            ]
            reply = await stub.StoreBatch(cache_pb2.StoreBatchRequest(stores=batch), timeout=10)
            first, refused, third = reply.results
            assert first.entry_id == exact_key(scope_tuple(scope()), "where is my parcel")
            assert third.entry_id
            assert not third.code
            assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == refused.code
            assert refused.message == "refusing to cache a prediction with no label"
            assert not refused.entry_id
            # The same refusal through Store, as a status.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await store(stub, "no label here", label="")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == refused.message
            for text in ("where is my parcel", "reset my password"):
                assert (await lookup(stub, text)).outcome == EXACT

    run(body)


def test_a_row_the_collection_cannot_hold_is_refused_not_written(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (_, stub):
            long_tenant = scope(tenant="t" * 257)  # the collection's names hold 256 bytes
            batch = [
                request("where is my parcel"),
                request("reset my password"),
                request("long " * 13_200),  # 66,000 bytes: over a VARCHAR's 65,535
            ]
            batch[1].scope.CopyFrom(long_tenant)
            reply = await stub.StoreBatch(cache_pb2.StoreBatchRequest(stores=batch), timeout=10)
            kept, refused, too_long = reply.results
            assert not kept.code
            assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == refused.code
            assert refused.message == "scope tenant is over 256 bytes"
            assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == too_long.code
            assert too_long.message == "text is over 65535 bytes"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await store(stub, "reset my password", scope=long_tenant)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Milvus would have refused the row, and with it the write of its batch-mates.
            await written(stub)
            assert (await lookup(stub, "where is my parcel")).outcome == EXACT

    run(body)


def test_a_batch_past_its_bound_is_refused_whole(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (service, stub):
            batch = [request(f"question {i}") for i in range(1025)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.StoreBatch(cache_pb2.StoreBatchRequest(stores=batch), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 1024" in (err.value.details() or "")
            assert service.counts[CacheCount.STORES] == 0

    run(body)


def test_a_key_watch_lists_held_keys_then_stores_and_drops(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (_, stub):
            old = await store(stub, "where is my parcel")
            await written(stub)  # one key in the index
            pending = await store(stub, "reset my password")  # and one still pending
            stream = stub.WatchInvalidations(cache_pb2.WatchInvalidationsRequest(keys=True))
            live = await stream.read()
            assert live.live
            listed: set[str] = set()
            while not (message := await stream.read()).keys_synced:
                listed |= {k for group in message.held for k in group.entry_ids}
            assert listed == {old, pending}
            new = await store(stub, "cancel my order")
            held = await stream.read()
            assert [list(g.entry_ids) for g in held.held] == [[new]]
            assert held.held[0].scope.tenant == scope().tenant
            await stub.Invalidate(cache_pb2.InvalidateRequest(entry_ids=[old]), timeout=10)
            dropped = await stream.read()
            assert list(dropped.entry_ids) == [old]
            stream.cancel()

    run(body)


def test_a_cache_that_reads_milvus_for_exact_lookups_lists_no_keys(tmp_path: Path) -> None:
    async def body() -> None:
        async with cache(tmp_path / "cache.db", exact_fallback=ExactFallback.ALL) as (_, stub):
            await store(stub, "where is my parcel")
            stream = stub.WatchInvalidations(cache_pb2.WatchInvalidationsRequest(keys=True))
            assert (await stream.read()).live
            await store(stub, "reset my password")  # no key event follows
            await stub.Invalidate(
                cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant="nobody")), timeout=10
            )
            message = await stream.read()  # the invalidation is the next message
            assert message.HasField("scope")
            assert not message.held
            assert not message.keys_synced
            stream.cancel()

    run(body)


def test_a_store_with_another_answer_for_a_held_key_drops_the_watchers_copies(
    tmp_path: Path,
) -> None:
    """A REFRESH (or any store over an entry) gave the cache a new answer, and every other
    gateway kept serving the old one from its local tier until its TTL: nothing told them.
    The same answer again says nothing; another answer is an event for the key, pending or
    written."""

    async def body() -> None:
        async with cache(tmp_path / "cache.db") as (_, stub):
            key = await store(stub, "where is my parcel", label="order_status")
            stream = stub.WatchInvalidations(cache_pb2.WatchInvalidationsRequest())
            assert (await stream.read()).live
            assert await store(stub, "where is my parcel", label="order_status") == key
            # A score off in the last bits (another batch's padding) is the same answer.
            await stub.Store(
                cache_pb2.StoreRequest(
                    scope=scope(),
                    text="where is my parcel",
                    prediction=common_pb2.Prediction(label="order_status", score=0.90001),
                    mode="exact",
                ),
                timeout=10,
            )
            assert await store(stub, "where is my parcel", label="delivery_delay") == key
            replaced = await asyncio.wait_for(stream.read(), 10)  # the same answer: nothing
            assert list(replaced.entry_ids) == [key]
            await written(stub)
            await store(stub, "where is my parcel", label="order_status")  # over the index's
            assert list((await asyncio.wait_for(stream.read(), 10)).entry_ids) == [key]
            hit = await lookup(stub, "where is my parcel")
            assert hit.prediction.label == "order_status"
            stream.cancel()

    run(body)
