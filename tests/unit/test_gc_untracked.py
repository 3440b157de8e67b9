"""What a cache holds per entry must not be walked by the garbage collector.

A full collection walks every object the collector tracks, with the process's event loop
stopped; the collector starts one whenever the tracked objects have grown by a quarter. The
exact index holds up to millions of entries (HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES), so one
tracked object per entry would make those pauses grow with the cache (290 ms at 1M entries on
the 2-core VM, measured with `Entry` instances held).
"""

from __future__ import annotations

import gc

from hopline.cache.exact_index import ExactIndex
from hopline.cache.keys import exact_key
from hopline.cache.store import Entry

ENTRIES = 5000
NOW = 1_000_000.0


def _fields(count: int) -> list[tuple[str, tuple[str, str, str, str], str]]:
    """(key, scope, text) per entry, built at run time as a Milvus row or a Store builds them."""
    out = []
    for i in range(count):
        scope = (f"tenant-{i % 3}", "model", str(1 + i % 2), "{}")
        text = f"where is my order {i}"
        out.append((exact_key(scope, text), scope, text))
    return out


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_the_exact_index_adds_no_tracked_object_per_entry() -> None:
    index = ExactIndex(2 * ENTRIES)
    fields = _fields(ENTRIES)
    before = tracked()
    for i, (key, scope, text) in enumerate(fields):
        index.put(Entry(key, scope, text, b"answer", NOW, NOW + 60 + i))
    added = tracked() - before
    assert len(index) == ENTRIES
    # A handful for the per-(tenant, model) key sets, none per entry.
    assert added < ENTRIES // 100, f"{added} tracked objects for {ENTRIES} entries"
    # What a lookup gets back is the entry that was put, field for field.
    key, scope, text = fields[7]
    assert index.get(key, NOW) == Entry(key, scope, text, b"answer", NOW, NOW + 67)
