"""The cache's side of a miss at the gateway (gateway/cache_path.py): the key mirror that
spares exact-only misses their lookup, stores lingering into one StoreBatch, the local exact
tier answering a repeat before its store has gone, and a cache without StoreBatch (a real
GatewayService over stand-in upstreams, tests/gateway_stand_ins.py).
"""

from __future__ import annotations

import asyncio

import grpc

from conftest import until
from gateway_stand_ins import (
    EXACT,
    EXACT_ONLY,
    MISS,
    MODEL,
    Mesh,
    changed,
    hops,
    rpc_error,
    run,
)
from hopline.cache.keys import exact_key, scope_tuple
from hopline.gateway.resilience import CircuitState
from hopline.protos.hopline.common.v1 import common_pb2


def exact_only_key(text: str) -> str:
    """The cache's exact key for `text` under EXACT_ONLY, as the gateway's predict scopes it."""
    scope = common_pb2.Scope(
        tenant="default", model=EXACT_ONLY, model_version="1", parameters={"top_k": "1"}
    )
    return exact_key(scope_tuple(scope), text)


def test_an_exact_only_miss_the_key_mirror_knows_sends_no_lookup() -> None:
    held, new, other = "reset my password", "where is my parcel", "cancel my order"

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.key_mirror.synced)
        m.cache.entries[held] = (common_pb2.Prediction(label="billing", score=0.9), EXACT)
        before = await m.counters()

        hit = await m.predict(held, model=EXACT_ONLY)  # listed: looked up
        miss = await m.predict(new, model=EXACT_ONLY)  # not listed: no lookup
        await m.settle()
        again = await m.predict(new, model=EXACT_ONLY)  # its store returned: looked up now
        semantic = await m.predict(other)  # a semantic model's miss is always looked up
        await m.settle()

        assert hit.cache.outcome == EXACT
        assert hit.prediction.label == "billing"
        assert miss.cache.outcome == MISS
        assert miss.cache.detail.startswith("not held by the cache")
        assert "cache_lookup" in hops(hit)
        assert "cache_lookup" not in hops(miss)
        assert (again.cache.outcome, semantic.cache.outcome) == (EXACT, MISS)
        assert [(r.text, r.scope.model) for r in m.cache.lookups] == [
            (held, EXACT_ONLY),
            (new, EXACT_ONLY),
            (other, MODEL),
        ]
        assert len(m.cache.stores) == 2  # the exact-only miss and the semantic one
        counts = changed(before, await m.counters())
        # Both stores' keys are held from their replies on, as the cache lists every key.
        assert (counts["cache_known_miss"], counts["key_mirror_keys"]) == (1, 2)

    run(scenario, listing=[exact_only_key(held)], key_mirror_keys=100)


def test_without_a_listing_every_exact_only_miss_is_looked_up() -> None:
    """A cache that cannot vouch for its keys (a Milvus fallback, peers) never ends a listing:
    the mirror stays unsynced and nothing is skipped."""

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.exact_tier.live)
        reply = await m.predict("where is my parcel", model=EXACT_ONLY)
        assert reply.cache.outcome == MISS
        assert "cache_lookup" in hops(reply)
        assert not m.gateway.key_mirror.synced
        assert len(m.cache.lookups) == 1

    run(scenario, key_mirror_keys=100)


STORED_TEXTS = [
    "where is my parcel",
    "reset my password",
    "cancel my order",
    "refuse this one",
    "update my card",
    "talk to a human",
]


def test_stores_that_linger_together_go_in_one_store_batch() -> None:
    """Stores wait HOPLINE_GATEWAY_STORE_LINGER_MS for others, then go in one StoreBatch,
    each still accepted or refused on its own."""

    async def scenario(m: Mesh) -> None:
        before = await m.counters()
        replies = await asyncio.gather(*(m.predict(t, model=EXACT_ONLY) for t in STORED_TEXTS))
        assert {r.cache.outcome for r in replies} == {MISS}  # answered before any store
        assert m.cache.store_batches == []  # still lingering
        await m.settle()
        assert m.cache.store_batches == [len(STORED_TEXTS)]
        assert sorted(s.text for s in m.cache.stores) == sorted(STORED_TEXTS[:3] + STORED_TEXTS[4:])
        counts = changed(before, await m.counters())
        assert (counts["stores"], counts["store_errors"]) == (5, 1)  # the refused one alone

    run(scenario, store_linger_ms=30.0)


def test_without_a_linger_stores_waiting_for_a_free_call_go_together() -> None:
    """No linger: one StoreBatch call in flight (the stages' default) goes alone at once; the
    stores that come while it waits go together in the next."""

    async def scenario(m: Mesh) -> None:
        m.cache.store_gate = asyncio.Event()
        before = await m.counters()
        replies = await asyncio.gather(*(m.predict(t, model=EXACT_ONLY) for t in STORED_TEXTS))
        assert {r.cache.outcome for r in replies} == {MISS}
        await until(lambda: sum(m.cache.store_batches) == 1)  # the one in flight, alone
        m.cache.store_gate.set()
        await m.settle()
        assert m.cache.store_batches == [1, len(STORED_TEXTS) - 1]
        assert sorted(s.text for s in m.cache.stores) == sorted(STORED_TEXTS[:3] + STORED_TEXTS[4:])
        counts = changed(before, await m.counters())
        assert (counts["stores"], counts["store_errors"]) == (5, 1)

    run(scenario, store_linger_ms=0.0)


def test_a_repeat_while_its_store_lingers_is_answered_by_the_gateway() -> None:
    """The gateway keeps its own answer from the moment it schedules the store, so a repeat
    that comes before the store is sent is an exact hit with no hop, not a second inference."""

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.exact_tier.live)
        miss = await m.predict("where is my parcel", model=EXACT_ONLY)
        repeat = await m.predict("where is my parcel", model=EXACT_ONLY)
        assert m.cache.store_batches == []  # the store had not gone yet
        assert (miss.cache.outcome, repeat.cache.outcome) == (MISS, EXACT)
        assert repeat.cache.detail == "answered by the gateway's local exact tier"
        assert len(m.inference.requests) == 1
        await m.settle()
        assert [s.text for s in m.cache.stores] == ["where is my parcel"]

    run(scenario, local_exact_entries=100, store_linger_ms=200.0)


def test_a_cache_without_store_batch_gets_one_store_call_each() -> None:
    """A cache from before StoreBatch (a rolling upgrade) answers it UNIMPLEMENTED: the store
    goes by Store instead, and so do the next ones for a while."""

    async def scenario(m: Mesh) -> None:
        m.cache.store_batch_error = rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        before = await m.counters()
        await m.predict("where is my parcel", model=EXACT_ONLY)
        await m.settle()
        await m.predict("reset my password", model=EXACT_ONLY)
        await m.settle()
        assert m.cache.store_batches == [1]  # tried once
        assert [s.text for s in m.cache.stores] == ["where is my parcel", "reset my password"]
        counts = changed(before, await m.counters())
        assert (counts["stores"], counts.get("store_errors", 0)) == (2, 0)

    run(scenario)


def test_an_open_circuit_is_probed_even_where_the_key_mirror_vouches_for_misses() -> None:
    """The cache failed (the circuit opened) and came back, its key listing synced again:
    exact-only misses must still send the probe lookup that closes the circuit, or no
    answer would ever be stored again. Found by `hopline run` restarting a killed cache."""

    async def scenario(m: Mesh) -> None:
        await until(lambda: m.gateway.key_mirror.synced)
        for _ in range(2):  # cache_breaker_failures
            m.gateway.breaker.failure()
        opened = m.gateway.breaker.state
        assert opened != CircuitState.CLOSED
        await asyncio.sleep(0.06)  # past the cooldown: the next lookup is the probe

        first = await m.predict("where is my parcel", model=EXACT_ONLY)
        await m.settle()
        again = await m.predict("where is my parcel", model=EXACT_ONLY)

        assert "cache_lookup" in hops(first)  # the probe, though the mirror knows the miss
        assert m.gateway.breaker.state == CircuitState.CLOSED
        assert (first.cache.outcome, again.cache.outcome) == (MISS, EXACT)

    run(scenario, listing=[], key_mirror_keys=100, cache_breaker_cooldown_s=0.05)
