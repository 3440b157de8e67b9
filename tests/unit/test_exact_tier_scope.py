"""gateway/exact_tier.py: a scope invalidation on the watch stream drops exactly the local
entries its scope covers (an empty field covers every value), whatever their parameters."""

from __future__ import annotations

from fake_clock import FakeClock

from hopline.gateway.exact_tier import FENCE_S, LocalEntry, LocalExactTier
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

SCOPES = [
    ("t1", "m", "1", "{}"),
    ("t1", "m", "2", '{"top_k":2}'),
    ("t1", "other", "1", "{}"),
    ("t2", "m", "1", "{}"),
]


def tier_with_every_scope() -> LocalExactTier:
    tier = LocalExactTier(capacity=100)
    tier.live = True
    for i, scope in enumerate(SCOPES):
        for j in range(3):
            entry = LocalEntry(common_pb2.Prediction(label=f"{i}"), scope, 0.0, 1e12)
            tier.put(f"{i}-{j}", entry, tier.generation)
    return tier


def left(tier: LocalExactTier) -> set[int]:
    return {i for i in range(len(SCOPES)) for j in range(3) if tier.get(f"{i}-{j}", 1.0)}


def test_a_scope_invalidation_drops_the_entries_it_covers_and_only_those() -> None:
    cases = [
        (common_pb2.Scope(tenant="t1"), {3}),
        (common_pb2.Scope(tenant="t1", model="m"), {2, 3}),
        (common_pb2.Scope(tenant="t1", model="m", model_version="2"), {0, 2, 3}),
        (common_pb2.Scope(model="m", model_version="1"), {1, 2}),
        (common_pb2.Scope(tenant="t3"), {0, 1, 2, 3}),
    ]
    for scope, kept in cases:
        tier = tier_with_every_scope()
        tier.apply(cache_pb2.WatchInvalidationsResponse(scope=scope))
        assert left(tier) == kept, scope
        assert len(tier) == 3 * len(kept)


def test_what_an_invalidation_names_is_not_copied_in_for_a_while() -> None:
    """With two cache replicas, one the event came from and one that had not read the shared
    log yet, a lookup sent after the event (past the generation check) answered the
    invalidated entry from the other, and the copy was served for its whole TTL (found by
    probing a gateway in front of two replicas on one Milvus server)."""
    clock = FakeClock()
    tier = LocalExactTier(capacity=100, clock=clock)
    tier.live = True
    scope = ("t1", "m", "1", "{}")
    stale = LocalEntry(common_pb2.Prediction(label="old"), scope, 0.0, 1e12)
    tier.apply(cache_pb2.WatchInvalidationsResponse(scope=common_pb2.Scope(tenant="t1")))
    tier.apply(cache_pb2.WatchInvalidationsResponse(entry_ids=["by-id"]))
    other = LocalEntry(common_pb2.Prediction(label="x"), ("t2", "m", "1", "{}"), 0.0, 1e12)
    for key, entry in (("in-scope", stale), ("by-id", other), ("elsewhere", other)):
        tier.put(key, entry, tier.generation)  # read after both events: the check passes
    assert tier.get("in-scope", 1.0) is None
    assert tier.get("by-id", 1.0) is None
    assert tier.get("elsewhere", 1.0) is not None  # named by neither
    clock.now += FENCE_S + 0.1  # every replica has long read the log
    tier.put("in-scope", stale, tier.generation)
    tier.put("by-id", other, tier.generation)
    assert tier.get("in-scope", 1.0) is not None
    assert tier.get("by-id", 1.0) is not None
