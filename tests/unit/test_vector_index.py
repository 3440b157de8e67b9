"""The semantic tier's in-memory vectors (cache/vector_index.py): the same nearest entries as a
brute-force search over what is live, whatever was put, replaced and removed, and searched
from memory only while they hold a scope whole."""

from __future__ import annotations

import numpy as np

from hopline.cache.exact_index import ExactIndex
from hopline.cache.store import Entry, Scope, ScopeFilter
from hopline.cache.vector_index import COMPACT_MIN_DEAD, VectorIndex, nearest

DIM = 16
A: Scope = ("a", "m", "1", "")
B: Scope = ("b", "m", "1", "")


def unit(rng: np.random.Generator) -> np.ndarray:
    v = rng.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def entry(key: str, scope: Scope = A, expires_at: float = 1e12) -> Entry:
    return Entry(key, scope, f"text {key}", b"answer", 0.0, expires_at)


def brute(live: dict[str, np.ndarray], query: np.ndarray, k: int) -> list[tuple[str, float]]:
    sims = sorted(((float(v @ query), key) for key, v in live.items()), reverse=True)
    return [(key, sim) for sim, key in sims[:k]]


def test_nearest_matches_a_brute_force_search_through_puts_replacements_and_removals() -> None:
    rng = np.random.default_rng(7)
    index = VectorIndex(DIM, max_rows=100_000)
    live: dict[str, np.ndarray] = {}
    for step in range(3000):  # enough removals to compact the block several times
        key = f"k{rng.integers(0, 700)}"
        if rng.random() < 0.45 and key in live:
            index.remove(key)
            del live[key]
        else:
            v = unit(rng) * np.float32(rng.uniform(0.5, 3.0))  # stored normalised
            index.put(key, A, v)
            live[key] = v / np.linalg.norm(v)
        if step % 300 == 0:
            query = unit(rng)
            snapshot = index.snapshot(A)
            got = nearest(snapshot, [query], 4)[0] if snapshot else []
            want = brute(live, query, 4)
            assert [k for k, _ in got] == [k for k, _ in want]
            np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
    assert len(index) == len(live)


def test_removed_rows_never_come_back_and_compaction_keeps_the_living() -> None:
    rng = np.random.default_rng(3)
    index = VectorIndex(DIM, max_rows=10_000)
    vectors = {f"k{i}": unit(rng) for i in range(COMPACT_MIN_DEAD * 3)}
    for key, v in vectors.items():
        index.put(key, A, v)
    doomed = list(vectors)[: COMPACT_MIN_DEAD * 2]
    for key in doomed:
        index.remove(key)
    for key in doomed:
        snapshot = index.snapshot(A)
        assert snapshot is not None
        found = dict(nearest(snapshot, [vectors[key]], len(vectors))[0])
        assert key not in found
        assert len(found) == len(vectors) - len(doomed)
    # A search still reading the arrays of before a compaction sees no removed key either.
    before = index.snapshot(A)
    index.remove(list(vectors)[-1])
    assert before is not None
    assert list(vectors)[-1] not in dict(nearest(before, [vectors[list(vectors)[-1]]], 10)[0])


def test_scopes_never_share_a_search() -> None:
    rng = np.random.default_rng(1)
    index = VectorIndex(DIM, max_rows=100)
    v = unit(rng)
    index.put("only-a", A, v)
    assert index.snapshot(B) is None
    snapshot = index.snapshot(A)
    assert snapshot is not None
    assert nearest(snapshot, [v], 4)[0][0][0] == "only-a"


def test_a_scope_is_searched_in_memory_only_while_held_whole() -> None:
    rng = np.random.default_rng(2)
    index = VectorIndex(DIM, max_rows=3)
    assert index.holds_whole(A)
    index.unread([A])  # had entries at start-up
    assert not index.holds_whole(A)
    assert index.needs_reading(A)
    index.put("new", A, unit(rng))  # written after the start: held, the scope still not whole
    read = [("new", unit(rng)), ("old", unit(rng)), ("gone", unit(rng))]
    # "gone" left the exact index while the read was on its way: not added.
    assert index.absorb(A, read, held={"new", "old"}) == 1
    assert index.holds_whole(A)
    assert not index.needs_reading(A)
    assert len(index) == 2
    index.put("third", A, unit(rng))
    index.put("fourth", A, unit(rng))  # past max_rows: the scope goes to Milvus for good
    assert not index.holds_whole(A)
    assert not index.needs_reading(A)
    assert index.snapshot(A) is None
    assert len(index) == 0
    index.put("more", A, unit(rng))
    assert len(index) == 0
    # A vector a search cannot compare: the scope goes to Milvus rather than the writer failing.
    index.put("zero", B, np.zeros(DIM, np.float32))
    assert not index.holds_whole(B)
    index.put("nan", (*B[:3], "p"), np.full(DIM, np.nan, np.float32))
    assert not index.holds_whole((*B[:3], "p"))
    assert len(index) == 0


def test_the_exact_index_keeps_the_vectors_in_step() -> None:
    rng = np.random.default_rng(4)
    vectors = VectorIndex(DIM, max_rows=100)
    exact = ExactIndex(max_entries=3, vectors=vectors)
    exact.put(entry("s1"), unit(rng))
    exact.put(entry("s2", expires_at=5.0), unit(rng))
    exact.put(entry("x1", scope=B))  # an exact-only entry: no vector
    assert len(vectors) == 2
    exact.put(entry("s1"))  # the same key stored again without a vector (exact mode now)
    assert len(vectors) == 1
    assert exact.expire(now=10.0) == ["s2"]
    assert len(vectors) == 0
    assert vectors.holds_whole(A)
    exact.put(entry("s3"), unit(rng))
    exact.put(entry("s4"), unit(rng))  # past the exact index's bound: x1 leaves for room
    assert not vectors.holds_whole(B)  # Milvus keeps it, memory does not
    assert vectors.holds_whole(A)
    assert len(vectors) == 2
    exact.put(entry("s5"), unit(rng))  # s1 leaves for room: A is no longer held whole
    assert not vectors.holds_whole(A)
    assert len(vectors) == 0


def test_a_rebuilt_index_waits_for_its_vectors_and_removals_reach_them() -> None:
    rng = np.random.default_rng(5)
    vectors = VectorIndex(DIM, max_rows=100)
    exact = ExactIndex(max_entries=100, vectors=vectors)
    exact.load([entry("r1"), entry("r2"), entry("rb", scope=B)], now=0.0)
    assert vectors.needs_reading(A)
    assert vectors.needs_reading(B)
    vectors.absorb(A, [("r1", unit(rng)), ("r2", unit(rng))], exact)
    assert vectors.holds_whole(A)
    assert len(vectors) == 2
    exact.remove(["r1"])
    assert len(vectors) == 1
    exact.remove_scope(ScopeFilter(tenant="a"))
    assert len(vectors) == 0
