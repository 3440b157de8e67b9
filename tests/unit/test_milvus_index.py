"""A cache collection is made and indexed without pymilvus's half-second sleep
(cache/milvus_index.py): on milvus-lite the store opens a new database indexed and loaded,
and nothing sleeps pymilvus's interval; an index still building is read again at growing
intervals, and one that fails or outlasts the deadline is said.

Stand-in: the last two use a client object standing in for Milvus, because neither milvus-lite
nor a Milvus server can be made to keep an empty collection's index building, or to fail it, on
demand."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hopline.cache.milvus_index import FIRST_WAIT_S, IndexNotBuilt, build_index
from hopline.cache.milvus_store import MilvusStore, quiet_pymilvus

PYMILVUS_WAIT_S = 0.5  # pymilvus.client.grpc_handler.wait_for_creating_index's sleep


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every time.sleep in this process while the test runs (each one still sleeps)."""
    slept: list[float] = []
    real = time.sleep

    def recorded(seconds: float) -> None:
        slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    return slept


def test_a_new_database_opens_indexed_without_pymilvus_sleeping(
    tmp_path: Path, sleeps: list[float]
) -> None:
    store = MilvusStore(str(tmp_path / "cache.db"), "c", 4, timeout_s=5.0)
    try:
        assert PYMILVUS_WAIT_S not in sleeps
        index = store._client.describe_index(store.collection, "vector")
        assert index["state"] == "Finished"
        assert index["metric_type"] == "COSINE"
        assert store.count() == 0
    finally:
        store.close()


def test_pymilvus_given_the_index_with_the_collection_sleeps_its_interval(
    tmp_path: Path, sleeps: list[float]
) -> None:
    """What the module replaces, so the test above can tell the two apart."""
    pymilvus = quiet_pymilvus()
    client = pymilvus.MilvusClient(str(tmp_path / "plain.db"))
    try:
        schema = pymilvus.MilvusClient.create_schema(auto_id=False)
        schema.add_field("id", pymilvus.DataType.VARCHAR, is_primary=True, max_length=8)
        schema.add_field("vector", pymilvus.DataType.FLOAT_VECTOR, dim=4)
        index = client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="COSINE")
        client.create_collection("plain", schema=schema, index_params=index)
        assert PYMILVUS_WAIT_S in sleeps
    finally:
        client.close()


class BuildingIndex:
    """Stands in for a pymilvus client whose index reads `states` in turn, then its last."""

    def __init__(self, *states: str) -> None:
        self.states = list(states)
        self.asked: list[dict[str, Any]] = []
        self.reads = 0

    def create_index(self, collection: str, params: Any, **kwargs: Any) -> None:
        self.asked.append(kwargs)

    def describe_index(self, collection: str, index: str, **kwargs: Any) -> dict[str, str]:
        self.reads += 1
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return {"index_name": index, "state": state}


def index_params() -> Any:
    pymilvus = quiet_pymilvus()
    params = pymilvus.MilvusClient.prepare_index_params()
    params.add_index(field_name="vector", index_type="FLAT", metric_type="COSINE")
    return params


def fake_clock() -> tuple[Callable[[], float], Callable[[float], None], list[float]]:
    now = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    return (lambda: now[0]), sleep, waits


def test_an_index_still_building_is_read_again_at_growing_intervals() -> None:
    client = BuildingIndex("InProgress", "InProgress", "InProgress", "Finished")
    clock, sleep, waits = fake_clock()
    build_index(client, "c", index_params(), 30.0, clock=clock, sleep=sleep)
    assert client.asked == [{"timeout": 30.0, "sync": False}]  # pymilvus's own wait not asked
    assert client.reads == 4
    assert waits == [FIRST_WAIT_S, 2 * FIRST_WAIT_S, 4 * FIRST_WAIT_S]


def test_an_index_that_fails_or_outlasts_the_deadline_is_said() -> None:
    clock, sleep, _ = fake_clock()
    with pytest.raises(IndexNotBuilt, match="failed to build index 'vector' of 'c'"):
        build_index(
            BuildingIndex("InProgress", "Failed"),
            "c",
            index_params(),
            30.0,
            clock=clock,
            sleep=sleep,
        )
    clock, sleep, waits = fake_clock()
    with pytest.raises(IndexNotBuilt, match=r"not built within 2s \(its state: InProgress\)"):
        build_index(BuildingIndex("InProgress"), "c", index_params(), 2.0, clock=clock, sleep=sleep)
    assert sum(waits) <= 2.0
