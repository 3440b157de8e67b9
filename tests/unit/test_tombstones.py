"""cache/tombstones.py: what a lookup's lagging read of Milvus must not bring back."""

from __future__ import annotations

from hopline.cache.store import Entry, LookupConsistency, ScopeFilter
from hopline.cache.tombstones import Tombstones

KEEP_S = 10.0


def entry(key: str, tenant: str = "acme", model: str = "m", version: str = "1") -> Entry:
    return Entry(
        key=key.rjust(64, "0"),
        scope=(tenant, model, version, ""),
        text="where is my parcel",
        response=b"",
        created_at=0.0,
        expires_at=1e12,
    )


def test_a_buried_id_is_hidden_until_its_stone_expires() -> None:
    stones = Tombstones(KEEP_S)
    stones.bury([entry("a").key], None, now=100.0)
    assert stones.hides(entry("a"), now=100.0)
    assert stones.hides(entry("a"), now=100.0 + KEEP_S - 0.01)
    assert not stones.hides(entry("a"), now=100.0 + KEEP_S)
    assert not stones.hides(entry("b"), now=100.0)


def test_a_buried_scope_hides_its_entries_and_no_other_tenants() -> None:
    stones = Tombstones(KEEP_S)
    stones.bury([], ScopeFilter(tenant="acme", model="m"), now=0.0)
    assert stones.hides(entry("a"), now=1.0)
    assert stones.hides(entry("b", version="2"), now=1.0)  # every version of the model
    assert not stones.hides(entry("c", tenant="globex"), now=1.0)
    assert not stones.hides(entry("d", model="other"), now=1.0)
    assert not stones.hides(entry("a"), now=KEEP_S)


def test_a_version_scope_leaves_the_models_other_versions() -> None:
    stones = Tombstones(KEEP_S)
    stones.bury([], ScopeFilter(model="m", model_version="1"), now=0.0)
    assert stones.hides(entry("a", tenant="any"), now=1.0)
    assert not stones.hides(entry("b", version="2"), now=1.0)


def test_expired_stones_are_dropped_and_a_reburied_id_lasts_from_its_new_burial() -> None:
    stones = Tombstones(KEEP_S)
    stones.bury([entry(f"{i:x}").key for i in range(100)], ScopeFilter(tenant="t"), now=0.0)
    assert len(stones) == 101
    stones.bury([entry("0").key], None, now=KEEP_S + 1)  # every earlier stone has expired
    assert len(stones) == 1
    assert stones.hides(entry("0"), now=2 * KEEP_S)
    assert not stones.hides(entry("1"), now=KEEP_S + 1)


def test_lookup_consistency_names_milvus_levels() -> None:
    assert LookupConsistency("bounded").milvus_level == "Bounded"
    assert LookupConsistency("strong").milvus_level == "Strong"


def test_an_id_buried_again_before_its_first_stone_expires_keeps_the_later_one() -> None:
    stones = Tombstones(KEEP_S)
    stones.bury([entry("a").key, entry("b").key], None, now=0.0)
    stones.bury([entry("a").key], None, now=5.0)
    stones.bury([], None, now=KEEP_S + 1)  # the first burial's stones expire here
    assert stones.hides(entry("a"), now=KEEP_S + 1)
    assert not stones.hides(entry("b"), now=KEEP_S + 1)
    assert len(stones) == 1
    stones.bury([], None, now=5.0 + KEEP_S)
    assert len(stones) == 0


def test_a_large_invalidation_expires_whole_but_for_the_ids_buried_again() -> None:
    """An Invalidate of 60,000 ids, ten of them buried again later, then another of 60,000:
    the first's stones leave together at its expiry, the ten stay until theirs. Behaviour
    only: the expiry's cost (1.02 s -> 0.004 s for these 60,000, measured when burials were
    made batches) is no test's business here, as a time bound would be the machine's."""
    stones = Tombstones(KEEP_S)
    first = [f"{i:064x}" for i in range(60_000)]
    second = [f"{i:064x}" for i in range(60_000, 120_000)]
    stones.bury(first, None, now=0.0)
    stones.bury(first[:10], None, now=1.0)  # ten buried again: they stay
    stones.bury(second, None, now=KEEP_S + 0.5)
    assert len(stones) == 60_010
    assert stones.hides(entry(first[0]), now=KEEP_S + 0.5)
    assert not stones.hides(entry(first[10]), now=KEEP_S + 0.5)


def test_a_store_is_fenced_by_an_invalidation_not_by_an_eviction() -> None:
    """cache/intake.py refuses a store its `fences` names: an answer that may predate the
    invalidation. An evicted entry was right; a store of it again is taken."""
    stones = Tombstones(KEEP_S)
    evicted, invalidated, other = entry("e"), entry("i"), entry("o")
    stones.bury([evicted.key], None, 0.0, invalidated=False)
    stones.bury([invalidated.key], None, 0.0)
    assert stones.hides(evicted, 1.0)  # hidden from a lagging read all the same
    assert not stones.fences(evicted.key, evicted.scope, 1.0)
    assert stones.fences(invalidated.key, invalidated.scope, 1.0)
    assert not stones.fences(other.key, other.scope, 1.0)
    stones.bury([], ScopeFilter("acme", "", ""), 2.0)
    assert stones.fences(other.key, other.scope, 3.0)
    assert not stones.fences(other.key, entry("o", tenant="umbrella").scope, 3.0)
    assert not stones.fences(invalidated.key, ("x", "m", "1", ""), KEEP_S + 0.5)  # expired
    assert stones.fences(other.key, other.scope, KEEP_S + 1.9)  # the scope's, buried later
    assert not stones.fences(other.key, other.scope, KEEP_S + 2.1)
    stones.bury([], None, 3 * KEEP_S)  # prunes every stone
    assert len(stones) == 0


def test_a_held_invalidation_hides_and_fences_until_released_then_for_keep_s() -> None:
    """A delete Milvus failed is held until its retry lands (cache/writer.py), however long
    that takes; then buried from the landing, as any delete is."""
    stones = Tombstones(KEEP_S)
    stones.hold([entry("a").key], ScopeFilter(tenant="acme", model="m"))
    stones.hold([entry("a").key], None)  # invalidated twice while Milvus is down
    late = 1e6
    assert stones.hides(entry("a"), now=late)
    assert stones.hides(entry("b"), now=late)  # the scope's
    assert not stones.hides(entry("c", tenant="globex"), now=late)
    assert stones.fences(entry("b").key, entry("b").scope, now=late)
    stones.release([entry("a").key], ScopeFilter(tenant="acme", model="m"), now=late)
    assert stones.hides(entry("a"), now=late + 2 * KEEP_S)  # the second hold stands
    assert stones.hides(entry("b"), now=late + KEEP_S - 0.01)
    assert not stones.hides(entry("b"), now=late + KEEP_S)
    stones.release([entry("a").key], None, now=late)
    assert not stones.hides(entry("a"), now=late + KEEP_S)
