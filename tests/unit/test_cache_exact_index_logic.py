"""The exact tier's in-memory index on its own: expiry, removal by key and by scope, bounds."""

from __future__ import annotations

from hopline.cache.exact_index import ExactIndex
from hopline.cache.keys import exact_key
from hopline.cache.store import Entry, ScopeFilter

NOW = 1_000_000.0


def entry(text: str, tenant: str = "t", model: str = "m", version: str = "1", **kw: float) -> Entry:
    scope = (tenant, model, version, "{}")
    return Entry(
        key=exact_key(scope, text),
        scope=scope,
        text=text,
        response=b"answer",
        created_at=kw.get("created_at", NOW),
        expires_at=kw.get("expires_at", NOW + 60),
    )


def test_expired_entries_are_never_returned() -> None:
    index = ExactIndex(10)
    short, long = entry("a", expires_at=NOW + 1), entry("b", expires_at=NOW + 100)
    index.put(short)
    index.put(long)
    assert index.get(short.key, NOW) == short
    assert index.get(short.key, NOW + 1) is None  # expires_at is exclusive, as in Milvus
    assert short.key not in index
    # Dropped by the read above, reported by the sweep with the one it drops itself.
    assert index.expire(NOW + 100) == [short.key, long.key]
    assert index.expire(NOW + 100) == []
    assert len(index) == 0


def test_a_replaced_entry_keeps_only_its_new_expiry() -> None:
    index = ExactIndex(10)
    old = entry("a", expires_at=NOW + 1)
    new = entry("a", created_at=NOW + 1, expires_at=NOW + 50)
    index.put(old)
    index.put(new)
    assert index.expire(NOW + 10) == []  # the stale heap item is skipped
    assert index.get(new.key, NOW + 10) == new


def test_removal_by_key_and_by_scope() -> None:
    index = ExactIndex(100)
    entries = [
        entry(text, tenant, model, version)
        for text in ("x", "y")
        for tenant in ("t1", "t2")
        for model in ("m1", "m2")
        for version in ("1", "2")
    ]
    for e in entries:
        index.put(e)
    assert index.remove([entries[0].key, entries[0].key]) == 1
    assert index.remove_scope(ScopeFilter(tenant="t1", model="m1", model_version="2")) == 2
    assert index.remove_scope(ScopeFilter(model="m2")) == 8
    assert index.remove_scope(ScopeFilter(tenant="t2")) == 4
    left = [e for e in entries if e.key in index]
    assert {(e.scope[0], e.scope[1], e.scope[2]) for e in left} == {("t1", "m1", "1")}
    assert index.count("t1", "m1") == 1
    assert index.count("t2", "m1") == 0


def test_the_whole_index_bound_drops_the_oldest_puts() -> None:
    index = ExactIndex(3)
    entries = [entry(f"q{i}", created_at=NOW + i) for i in range(5)]
    dropped = [k for e in entries for k in index.put(e)]
    assert dropped == [entries[0].key, entries[1].key]
    assert [e.key in index for e in entries] == [False, False, True, True, True]
    assert index.dropped_for_room == 2


def test_load_keeps_the_newest_live_entries() -> None:
    index = ExactIndex(2)
    entries = [entry(f"q{i}", created_at=NOW + i) for i in range(4)]
    dead = entry("gone", created_at=NOW + 9, expires_at=NOW)
    assert index.load([entries[3], dead, entries[0], entries[2], entries[1]], NOW) == 2
    assert [e.key in index for e in entries] == [False, False, True, True]
    assert dead.key not in index


def test_oldest_is_per_group_in_put_order_and_a_replacement_is_new() -> None:
    index = ExactIndex(100)
    mine = [entry(f"mine {i}") for i in range(5)]
    theirs = [entry(f"theirs {i}", tenant="other") for i in range(5)]
    for a, b in zip(mine, theirs, strict=True):
        index.put(b)  # another tenant's puts interleaved, older each time
        index.put(a)
    assert index.oldest("t", "m", 2) == [mine[0].key, mine[1].key]
    index.put(mine[0])  # stored again: now the newest
    index.remove([mine[1].key])
    assert index.oldest("t", "m", 3) == [mine[2].key, mine[3].key, mine[4].key]
    assert index.oldest("t", "m", 10)[-1] == mine[0].key
    assert index.oldest("other", "m", 1) == [theirs[0].key]
    assert index.oldest("nobody", "m", 5) == []
    assert index.count("t", "m") == 4
