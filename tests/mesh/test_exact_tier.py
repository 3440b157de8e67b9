"""The gateway's local exact tier: repeats without a hop, the cache's scope rules, and never
an entry the cache has dropped (invalidated, or unheard-of while the cache is down)."""

from __future__ import annotations

import time

import grpc

from harness import TOPOLOGIES, Mesh
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

# Every test here passes with the stateless stages in their own processes and in the gateway.
MESH_TOPOLOGIES = TOPOLOGIES

LOCAL = "answered by the gateway's local exact tier"
EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS


def predict(mesh: Mesh, text: str, tenant: str) -> gateway_pb2.PredictResponse:
    with grpc.insecure_channel(mesh.gateway) as channel:
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text=text, tenant=tenant), timeout=30
        )
    return reply


def invalidate(mesh: Mesh, **fields: object) -> int:
    with grpc.insecure_channel(mesh.addrs["cache"]) as channel:
        reply = cache_pb2_grpc.CacheServiceStub(channel).Invalidate(
            cache_pb2.InvalidateRequest(**fields),  # type: ignore[arg-type]
            timeout=10,
        )
    return int(reply.removed)


def wait_counter(mesh: Mesh, name: str, want: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while mesh.gateway_counters()[name] != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway counter {name} != {want}: {mesh.gateway_counters()}")
        time.sleep(0.05)


def test_repeat_is_answered_locally_within_its_scope(mesh: Mesh) -> None:
    wait_counter(mesh, "local_exact_live", 1)
    text = "I need to change the delivery address of my order"
    first = predict(mesh, text, "tier-a")
    assert first.cache.outcome == MISS
    mesh.settle()
    before = int(mesh.cache_stats().lookups)
    again = predict(mesh, "  i NEED to change the delivery address of my order ", "tier-a")
    assert again.cache.outcome == EXACT
    assert again.cache.detail == LOCAL
    assert again.prediction == first.prediction
    assert {t.hop for t in again.timings} == {"total"}  # no hop at all
    assert int(mesh.cache_stats().lookups) == before  # the cache service was not asked
    # Another tenant's identical text is another key: a miss, never tier-a's answer.
    other = predict(mesh, text, "tier-b")
    assert other.cache.outcome == MISS
    assert other.cache.detail != LOCAL


def test_a_text_the_model_reads_differently_is_not_an_exact_repeat(mesh: Mesh) -> None:
    """Full-width letters fold to ASCII under Unicode NFKC, but the model reads them as
    [UNK]s: the cached answer of the ASCII text is not theirs (the key follows the model's
    tokenizer, cache/keys.py)."""
    wait_counter(mesh, "local_exact_live", 1)
    ascii_text = "cancel my subscription"
    full_width = "".join(chr(ord(c) + 0xFEE0) if c != " " else c for c in ascii_text)
    stored = predict(mesh, ascii_text, "widths")
    assert stored.prediction.label == "cancel_subscription"
    mesh.settle()
    assert predict(mesh, ascii_text.upper(), "widths").cache.outcome == EXACT
    other = predict(mesh, full_width, "widths")
    assert other.cache.outcome == MISS
    assert other.prediction.label != stored.prediction.label


def test_invalidation_reaches_the_local_copy(mesh: Mesh) -> None:
    wait_counter(mesh, "local_exact_live", 1)
    texts = ["please cancel my subscription today", "how do I reset my password"]
    for text in texts:
        predict(mesh, text, "tier-inval")
    mesh.settle()
    for text in texts:
        assert predict(mesh, text, "tier-inval").cache.detail == LOCAL
    by_id = predict(mesh, texts[0], "tier-inval").cache.entry_id
    held = int(mesh.gateway_counters()["local_exact_entries"])
    assert invalidate(mesh, entry_ids=[by_id]) == 1
    # The event travels on the watch stream after the delete: wait for it, not a guess.
    wait_counter(mesh, "local_exact_entries", held - 1)
    dropped = predict(mesh, texts[0], "tier-inval")
    assert dropped.cache.outcome == MISS
    assert predict(mesh, texts[1], "tier-inval").cache.detail == LOCAL  # untouched
    assert invalidate(mesh, scope=common_pb2.Scope(tenant="tier-inval")) >= 1
    wait_counter(mesh, "local_exact_entries", held - 2)
    assert predict(mesh, texts[1], "tier-inval").cache.outcome == MISS


def test_no_local_answers_while_the_cache_is_unreachable(mesh: Mesh) -> None:
    """Killed cache: the watch breaks, the copy is dropped, requests fail open to inference.

    Runs last in this module: it leaves the module's mesh without a cache.
    """
    wait_counter(mesh, "local_exact_live", 1)
    text = "talk to a human agent about my bill"
    predict(mesh, text, "tier-down")
    mesh.settle()
    assert predict(mesh, text, "tier-down").cache.detail == LOCAL
    mesh.kill("cache")
    wait_counter(mesh, "local_exact_live", 0)
    assert mesh.gateway_counters()["local_exact_entries"] == 0
    reply = predict(mesh, text, "tier-down")
    assert reply.cache.outcome == common_pb2.CACHE_OUTCOME_FAIL_OPEN
    assert reply.prediction.label  # answered by inference
