"""A long eviction is split into log rows a Milvus VARCHAR can hold, losing no id and
keeping the scope once (cache/shared_invalidations.py)."""

from __future__ import annotations

from hopline.cache.shared_invalidations import _IDS_PER_ROW, _MAX_EVENT, _split
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2


def ids(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(n)]


def test_a_short_event_is_one_row() -> None:
    event = cache_pb2.WatchInvalidationsResponse(entry_ids=ids(3))
    assert _split(event) == [event]


def test_a_long_eviction_is_split_and_each_row_fits() -> None:
    many = ids(2 * _IDS_PER_ROW + 7)
    event = cache_pb2.WatchInvalidationsResponse(scope=common_pb2.Scope(tenant="t"), entry_ids=many)
    parts = _split(event)
    assert len(parts) == 3
    assert [i for p in parts for i in p.entry_ids] == many
    assert [p.HasField("scope") for p in parts] == [True, False, False]
    assert all(len(p.SerializeToString().hex()) <= _MAX_EVENT for p in parts)
