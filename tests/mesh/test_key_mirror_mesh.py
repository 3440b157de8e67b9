"""The key mirror through the real cache and gateway processes: an exact-only miss that the
cache's key listing vouches for sends no Lookup; a stored key is looked up and hits; an
invalidated key is a known miss again; a restarted cache lists the keys it rebuilt from
Milvus; a cache that reads Milvus on an index miss never vouches for a miss."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.gateway import client
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2

EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS
FAIL_OPEN = common_pb2.CACHE_OUTCOME_FAIL_OPEN
KNOWN = "not held by the cache"


def new_mesh(default_repo: Path, work: Path, **service_env: dict[str, str]) -> Mesh:
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    # No local copies: a repeat reaches the cache, so its Lookup shows the mirror let it by.
    gateway = {"HOPLINE_GATEWAY_EXACT_ENTRIES": "0", **service_env.pop("gateway", {})}
    return Mesh(repo, work, service_env={"gateway": gateway, **service_env}).start()


@pytest.fixture(scope="module")
def kmesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = new_mesh(default_repo, tmp_path_factory.mktemp("key-mirror"))
    try:
        yield m
    finally:
        m.stop()


def predict(mesh: Mesh, text: str, tenant: str) -> gateway_pb2.PredictResponse:
    return client.predict(text, gateway=mesh.gateway, tenant=tenant, timeout_s=30)


def hops(reply: gateway_pb2.PredictResponse) -> set[str]:
    return {t.hop for t in reply.timings}


def lookups(mesh: Mesh) -> int:
    return int(mesh.cache_stats().lookups)


def wait_counter(
    mesh: Mesh, name: str, done: Callable[[int], bool], timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done(int(mesh.gateway_counters()[name])):
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway counter {name}: {mesh.gateway_counters()}")
        time.sleep(0.05)


def test_a_new_text_is_a_known_miss_and_its_repeat_is_looked_up(kmesh: Mesh) -> None:
    wait_counter(kmesh, "key_mirror_synced", lambda v: v == 1)
    text = "my package arrived damaged and I want a replacement"
    before = lookups(kmesh)
    first = predict(kmesh, text, "km-a")
    assert first.cache.outcome == MISS
    assert first.cache.detail.startswith(KNOWN)
    assert "cache_lookup" not in hops(first)
    assert lookups(kmesh) == before  # the cache service was not asked
    kmesh.settle()
    again = predict(kmesh, text, "km-a")
    assert again.cache.outcome == EXACT
    assert again.prediction == first.prediction
    assert lookups(kmesh) == before + 1
    # Another tenant's identical text is another key: known to be a miss.
    other = predict(kmesh, text, "km-b")
    assert other.cache.outcome == MISS
    assert other.cache.detail.startswith(KNOWN)


def test_an_invalidated_key_is_a_known_miss_again(kmesh: Mesh) -> None:
    wait_counter(kmesh, "key_mirror_synced", lambda v: v == 1)
    text = "how long does a refund take to reach my card"
    predict(kmesh, text, "km-inval")
    kmesh.settle()
    hit = predict(kmesh, text, "km-inval")
    assert hit.cache.outcome == EXACT
    held = int(kmesh.gateway_counters()["key_mirror_keys"])
    with grpc.insecure_channel(kmesh.addrs["cache"]) as channel:
        cache_pb2_grpc.CacheServiceStub(channel).Invalidate(
            cache_pb2.InvalidateRequest(entry_ids=[hit.cache.entry_id]), timeout=10
        )
    # The drop travels on the watch stream after the delete: wait for it, not a guess.
    wait_counter(kmesh, "key_mirror_keys", lambda v: v == held - 1)
    before = lookups(kmesh)
    after = predict(kmesh, text, "km-inval")
    assert after.cache.outcome == MISS
    assert after.cache.detail.startswith(KNOWN)
    assert lookups(kmesh) == before


def test_a_restarted_cache_lists_the_keys_it_rebuilt(kmesh: Mesh) -> None:
    """Runs after the others: it restarts the module's cache."""
    wait_counter(kmesh, "key_mirror_synced", lambda v: v == 1)
    text = "I forgot my password and cannot log in"
    predict(kmesh, text, "km-restart")
    kmesh.settle()
    assert kmesh.terminate("cache") == 0
    wait_counter(kmesh, "key_mirror_synced", lambda v: v == 0)
    kmesh.start(("cache",))
    wait_counter(kmesh, "key_mirror_synced", lambda v: v == 1)
    assert int(kmesh.gateway_counters()["key_mirror_keys"]) >= 1
    # Listed again from the rebuilt index: looked up, and a hit; a known miss here would be
    # a key the listing lost. The gateway's channel may need a moment to reconnect.
    deadline = time.monotonic() + 20
    while (reply := predict(kmesh, text, "km-restart")).cache.outcome != EXACT:
        assert reply.cache.outcome == FAIL_OPEN, reply.cache
        assert time.monotonic() < deadline, "the cache never answered after its restart"
        time.sleep(0.2)


def test_a_cache_that_reads_milvus_on_an_index_miss_never_vouches(
    default_repo: Path, tmp_path: Path
) -> None:
    mesh = new_mesh(default_repo, tmp_path, cache={"HOPLINE_CACHE_EXACT_FALLBACK": "all"})
    try:
        deadline = time.monotonic() + 30
        while not mesh.local_tier_live():  # the watch is up (its copy holds nothing here)
            assert time.monotonic() < deadline, mesh.gateway_counters()
            time.sleep(0.05)
        reply = predict(mesh, "is there a discount for students", "km-fallback")
        assert reply.cache.outcome == MISS
        assert "cache_lookup" in hops(reply)
        assert mesh.gateway_counters()["key_mirror_synced"] == 0
    finally:
        mesh.stop()
