"""The semantic cache against a real milvus-lite database, through real service processes.

Models with different cache policies are copies of the default model with an edited
config.json (policy lives in the model's config, as an operator would change it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh, add_model, answer_scope
from hopline.gateway.client import predict
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2

EXACT = common_pb2.CACHE_OUTCOME_EXACT
SEMANTIC = common_pb2.CACHE_OUTCOME_SEMANTIC
MISS = common_pb2.CACHE_OUTCOME_MISS
FAIL_OPEN = common_pb2.CACHE_OUTCOME_FAIL_OPEN


def make_repo(default_repo: Path, work: Path) -> Path:
    repo = work / "models"
    source = default_repo / DEFAULT_MODEL / "1"
    add_model(repo, source, "sem", "1", mode="semantic", threshold=0.8)
    add_model(repo, source, "sem", "2", mode="semantic", threshold=0.8)
    add_model(repo, source, "short", "1", mode="exact", ttl_s=1.5)
    add_model(repo, source, "small", "1", mode="exact", max_entries=3)
    add_model(repo, source, "picky", "1", mode="exact", min_score=0.99)
    return repo


@pytest.fixture(scope="module")
def cmesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("cmesh")
    m = Mesh(
        make_repo(default_repo, work),
        work,
        HOPLINE_DEFAULT_MODEL="sem",
        HOPLINE_CACHE_FLUSH_MS="2",
        HOPLINE_CACHE_BUDGET_MS="2000",  # a slow CI machine must not turn hits into fail-opens
        # These tests are about the cache service's own tiers: every exact repeat must reach
        # it. The gateway's local copy of exact entries has its tests in test_exact_tier.py.
        HOPLINE_GATEWAY_EXACT_ENTRIES="0",
    )
    try:
        yield m.start()
    finally:
        m.stop()


def cache_stub(mesh: Mesh) -> tuple[grpc.Channel, cache_pb2_grpc.CacheServiceStub]:
    channel = grpc.insecure_channel(mesh.addrs["cache"])
    return channel, cache_pb2_grpc.CacheServiceStub(channel)


def lookup(mesh: Mesh, text: str, tenant: str, model: str, version: str = "1") -> int:
    """The cache's own answer for what the gateway would ask, without storing anything."""
    scope = answer_scope(mesh.repo, tenant, model, version)
    channel, stub = cache_stub(mesh)
    with channel:
        found = stub.Lookup(cache_pb2.LookupRequest(scope=scope, text=text), timeout=10)
        return int(found.outcome)


def ask(mesh: Mesh, text: str, **kw: Any) -> gateway_pb2.PredictResponse:
    return predict(text, gateway=mesh.gateway, timeout_s=30, **kw)


def test_exact_then_semantic_then_miss(cmesh: Mesh) -> None:
    first = ask(cmesh, "where is my order, it has not arrived", tenant="t-tiers")
    assert first.cache.outcome == MISS
    cmesh.settle()
    exact = ask(cmesh, "  WHERE is my order,   it has not arrived ", tenant="t-tiers")
    assert exact.cache.outcome == EXACT, exact.cache
    assert exact.cache.similarity == pytest.approx(1.0)
    assert exact.prediction.label == first.prediction.label
    near = ask(cmesh, "where is my order? it has not arrived yet", tenant="t-tiers")
    assert near.cache.outcome == SEMANTIC, near.cache
    assert 0.8 <= near.cache.similarity < 1.0
    assert near.cache.entry_id == exact.cache.entry_id
    assert near.prediction.label == first.prediction.label
    far = ask(cmesh, "I forgot my password and cannot log in", tenant="t-tiers")
    assert far.cache.outcome == MISS, far.cache
    stats = cmesh.cache_stats()
    assert stats.exact_hits >= 1
    assert stats.semantic_hits >= 1
    assert stats.misses >= 2
    assert stats.lookup_p99_ms >= stats.lookup_p50_ms > 0


def test_tenants_never_see_each_others_entries(cmesh: Mesh) -> None:
    text = "please cancel my subscription today"
    assert ask(cmesh, text, tenant="tenant-a").cache.outcome == MISS
    cmesh.settle()
    a = ask(cmesh, text, tenant="tenant-a")
    assert a.cache.outcome == EXACT
    assert a.cache.entry_id  # a miss names no entry: compare with a hit's
    # Identical text, and a near paraphrase, from tenant B: never A's entry.
    assert ask(cmesh, text, tenant="tenant-b").cache.outcome == MISS
    cmesh.settle()
    b = ask(cmesh, text, tenant="tenant-b")
    assert b.cache.outcome == EXACT
    assert b.cache.entry_id != a.cache.entry_id
    b2 = ask(cmesh, "please cancel my subscription", tenant="tenant-b")
    assert b2.cache.outcome in (MISS, SEMANTIC)
    if b2.cache.outcome == SEMANTIC:  # only B's own entry may match
        assert b2.cache.entry_id == b.cache.entry_id


def test_model_version_and_parameters_are_part_of_the_scope(cmesh: Mesh) -> None:
    text = "how do I change my billing address"
    assert ask(cmesh, text, model="sem", model_version="1").cache.outcome == MISS
    cmesh.settle()
    assert ask(cmesh, text, model="sem", model_version="1").cache.outcome == EXACT
    assert ask(cmesh, text, model="sem", model_version="2").cache.outcome == MISS
    # top_k changes the answer, so it changes the key.
    assert ask(cmesh, text, model="sem", model_version="1", top_k=3).cache.outcome == MISS


def test_ttl_expiry(cmesh: Mesh) -> None:
    text = "my discount code does not work"
    assert ask(cmesh, text, model="short").cache.outcome == MISS
    cmesh.settle()
    hit = ask(cmesh, text, model="short")
    assert hit.cache.outcome == EXACT
    time.sleep(max(0.0, 1.6 - hit.cache.age_s))
    assert ask(cmesh, text, model="short").cache.outcome == MISS


def test_eviction_keeps_the_newest_entries(cmesh: Mesh) -> None:
    texts = [f"question number {i} about my account settings" for i in range(5)]
    for text in texts:
        ask(cmesh, text, model="small", tenant="evict")
        cmesh.settle()
    outcomes = [lookup(cmesh, t, "evict", "small") for t in texts]
    assert outcomes[:2] == [MISS, MISS], outcomes
    assert outcomes[2:] == [EXACT, EXACT, EXACT], outcomes
    assert cmesh.cache_stats().evictions >= 2


def test_hopline_cache_invalidate_drops_a_tenants_answers_everywhere(cmesh: Mesh) -> None:
    """The operator's command (cache/invalidate_cli.py): before it an operator had to write a
    gRPC client. The gateway's local copy goes too: the next ask is a MISS."""
    text = "do you ship to canada"
    ask(cmesh, text, tenant="cli-inv")
    cmesh.settle()
    assert ask(cmesh, text, tenant="cli-inv").cache.outcome == EXACT
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "cache", "invalidate", "--tenant", "cli-inv",
         "--cache", cmesh.addrs["cache"]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("invalidated: 1 entries"), run.stdout
    assert ask(cmesh, text, tenant="cli-inv").cache.outcome == MISS
    usage = subprocess.run(
        [sys.executable, "-m", "hopline", "cache", "invalidate", "--model-version", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert usage.returncode == 2
    assert usage.stderr == "hopline cache invalidate: error: --model-version needs --model\n"
    not_a_version = subprocess.run(
        [sys.executable, "-m", "hopline", "cache", "invalidate", "--model", "sem",
         "--model-version", "abc", "--cache", cmesh.addrs["cache"]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert not_a_version.returncode == 2
    assert "--model-version is a version number" in not_a_version.stderr


def test_hopline_cache_stats_shows_what_the_cache_holds(cmesh: Mesh) -> None:
    """The operator's view of GetStats (cache/stats_cli.py): the same figures as the RPC, as
    lines and as JSON (every counter, zeros too); an address with no cache is said, exit 1."""
    ask(cmesh, "what are your opening hours", tenant="cli-stats")
    cmesh.settle()
    held = cmesh.cache_stats()

    def stats(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hopline", "cache", "stats", *flags],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    lines = stats("--cache", cmesh.addrs["cache"])
    assert lines.returncode == 0, lines.stderr
    assert lines.stdout.startswith(f"cache at {cmesh.addrs['cache']}: "), lines.stdout
    assert f"\nentries {held.entries} (" in lines.stdout, lines.stdout
    assert "\nlookups " in lines.stdout
    as_json = stats("--cache", cmesh.addrs["cache"], "--json")
    assert as_json.returncode == 0, as_json.stderr
    figures = json.loads(as_json.stdout)
    assert figures["entries"] == held.entries
    assert figures["lookups"] >= held.lookups
    # Every counter is printed, a zero one too, as a number: `jq .store_errors` reads 0, not
    # null or "0" (protobuf's JSON mapping writes int64 as a string).
    assert figures["store_errors"] == held.store_errors == 0, figures
    nobody = stats("--cache", "127.0.0.1:9")
    assert nobody.returncode == 1
    assert nobody.stderr.startswith("error: UNAVAILABLE: "), nobody.stderr
    assert "(cache at 127.0.0.1:9)" in nobody.stderr


def test_invalidate_by_scope_and_by_id(cmesh: Mesh) -> None:
    one, two = "how long does shipping take", "can I pay with paypal"
    for tenant in ("inv-a", "inv-b"):
        ask(cmesh, one, tenant=tenant)
        ask(cmesh, two, tenant=tenant)
    cmesh.settle()
    hit = ask(cmesh, one, tenant="inv-a")
    assert hit.cache.outcome == EXACT
    channel, stub = cache_stub(cmesh)
    with channel:
        removed = stub.Invalidate(
            cache_pb2.InvalidateRequest(entry_ids=[hit.cache.entry_id]), timeout=10
        ).removed
        assert removed == 1
        assert ask(cmesh, one, tenant="inv-a").cache.outcome == MISS
        assert ask(cmesh, two, tenant="inv-a").cache.outcome == EXACT
        stub.Invalidate(
            cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant="inv-b", model="sem")),
            timeout=10,
        )
        assert ask(cmesh, one, tenant="inv-b").cache.outcome == MISS
        assert ask(cmesh, two, tenant="inv-b").cache.outcome == MISS
        assert ask(cmesh, two, tenant="inv-a").cache.outcome == EXACT  # other tenant untouched
        # Parameters are not matched: refused, not widened to every entry of the version.
        with pytest.raises(grpc.RpcError) as err:
            stub.Invalidate(
                cache_pb2.InvalidateRequest(
                    scope=common_pb2.Scope(tenant="inv-a", model="sem", parameters={"top_k": "1"})
                ),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not its parameters" in (err.value.details() or "")
        assert ask(cmesh, two, tenant="inv-a").cache.outcome == EXACT  # nothing went
        for bad in (
            cache_pb2.InvalidateRequest(scope=common_pb2.Scope()),
            cache_pb2.InvalidateRequest(entry_ids=['" or id != "']),
            cache_pb2.InvalidateRequest(),
            # No version is named so: it matched nothing, and "0 removed" read as done.
            cache_pb2.InvalidateRequest(scope=common_pb2.Scope(model="sem", model_version="0")),
            cache_pb2.InvalidateRequest(scope=common_pb2.Scope(model="sem", model_version="v1")),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Invalidate(bad, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_lookup_rejects_bad_requests(cmesh: Mesh) -> None:
    channel, stub = cache_stub(cmesh)
    scope = common_pb2.Scope(tenant="t", model="sem", model_version="1")
    with channel:
        for request, needle in (
            (cache_pb2.LookupRequest(scope=scope, text="x", mode="fuzzy"), "mode"),
            (cache_pb2.LookupRequest(scope=scope, text="x", mode="semantic"), "threshold"),
            (cache_pb2.LookupRequest(scope=common_pb2.Scope(tenant="t"), text="x"), "model"),
            # As Store refuses them: an empty text (a semantic lookup ran the encoder on it),
            # a tenant no entry can have.
            (cache_pb2.LookupRequest(scope=scope, text="  "), "text is empty"),
            (
                cache_pb2.LookupRequest(
                    scope=common_pb2.Scope(tenant="t" * 300, model="sem", model_version="1"),
                    text="x",
                ),
                "scope tenant is over 256 bytes",
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in (err.value.details() or "")


def test_out_of_scope_answers_are_not_stored(cmesh: Mesh) -> None:
    text = "what is the boiling point of tungsten in kelvin"
    first = ask(cmesh, text, tenant="oos")
    before = int(cmesh.gateway_counters()["stores_skipped_policy"])
    if not first.prediction.out_of_scope:
        pytest.fail(f"expected an out-of-scope answer for {text!r}, got {first.prediction}")
    again = ask(cmesh, text, tenant="oos")
    assert again.cache.outcome == MISS
    assert cmesh.gateway_counters()["stores_skipped_policy"] == before + 1


def test_answers_below_the_policys_min_score_are_not_stored(cmesh: Mesh) -> None:
    text = "where is my order"
    before = int(cmesh.gateway_counters()["stores_skipped_policy"])
    first = ask(cmesh, text, tenant="picky", model="picky")
    assert not first.prediction.out_of_scope
    assert first.prediction.score < 0.99, "pick a text the model is less sure of"
    cmesh.settle()
    again = ask(cmesh, text, tenant="picky", model="picky")
    assert again.cache.outcome == MISS
    assert cmesh.gateway_counters()["stores_skipped_policy"] == before + 2
    # The same answer under a policy without the bound is stored and replayed.
    ask(cmesh, text, tenant="picky", model="small")
    cmesh.settle()
    assert ask(cmesh, text, tenant="picky", model="small").cache.outcome == EXACT


def test_entries_survive_a_cache_restart(cmesh: Mesh) -> None:
    text = "do you ship to canada"
    ask(cmesh, text, tenant="persist")
    cmesh.settle()
    entries = cmesh.cache_stats().entries
    assert cmesh.terminate("cache") == 0
    cmesh.start(("cache",))
    assert cmesh.cache_stats().entries == entries
    # The gateway may still hold a broken connection for a moment; the cache must come back.
    deadline = time.monotonic() + 20
    while (outcome := ask(cmesh, text, tenant="persist").cache.outcome) != EXACT:
        assert outcome in (FAIL_OPEN, EXACT), outcome
        assert time.monotonic() < deadline, "cache never answered after the restart"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def slow_mesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Inference held for 300 ms by the test-only delay flag, so concurrent requests overlap
    for certain; a short breaker cool-down so recovery fits in a test."""
    work = tmp_path_factory.mktemp("slow")
    m = Mesh(
        make_repo(default_repo, work),
        work,
        service_env={"inference": {"HOPLINE_TEST_DELAY_MS": "300"}},
        HOPLINE_DEFAULT_MODEL="sem",
        HOPLINE_CACHE_BREAKER_FAILURES="3",
        HOPLINE_CACHE_BREAKER_COOLDOWN_S="1",
        HOPLINE_CACHE_BUDGET_MS="2000",
    )
    try:
        yield m.start()
    finally:
        m.stop()


def test_identical_concurrent_misses_run_inference_once(slow_mesh: Mesh) -> None:
    n = 8
    before = slow_mesh.gateway_counters()
    with ThreadPoolExecutor(n) as pool:
        replies = list(
            pool.map(lambda _: ask(slow_mesh, "is there a student discount", tenant="co"), range(n))
        )
    after = slow_mesh.gateway_counters()
    assert int(after["inferences"]) - int(before["inferences"]) == 1
    assert int(after["coalesced"]) - int(before["coalesced"]) == n - 1
    assert sum(r.cache.coalesced for r in replies) == n - 1
    assert {r.prediction.label for r in replies} == {replies[0].prediction.label}
    assert all(r.cache.outcome == MISS for r in replies)
    # Another tenant's identical text is another scope: its own inference.
    with ThreadPoolExecutor(2) as pool:
        other = list(
            pool.map(
                lambda t: ask(slow_mesh, "is there a student discount", tenant=t), ["x1", "x2"]
            )
        )
    assert not any(r.cache.coalesced for r in other)
    assert int(slow_mesh.gateway_counters()["inferences"]) - int(after["inferences"]) == 2


def test_a_request_joined_to_another_run_keeps_its_own_deadline(slow_mesh: Mesh) -> None:
    """The first request's deadline (250 ms) ends the inference it leads (300 ms); the
    identical request that joined it has 30 s, so it runs the model itself, not fail too."""
    text, tenant = "do you ship to iceland", "deadlines"
    before = slow_mesh.gateway_counters()
    with ThreadPoolExecutor(2) as pool:
        short = pool.submit(
            lambda: predict(text, gateway=slow_mesh.gateway, timeout_s=0.25, tenant=tenant)
        )
        time.sleep(0.05)  # the short one's run is under way
        joined = pool.submit(lambda: ask(slow_mesh, text, tenant=tenant))
        with pytest.raises(grpc.RpcError) as ended:
            short.result()
        reply = joined.result()
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reply.cache.outcome == MISS
    assert reply.prediction.label
    assert not reply.cache.coalesced  # its answer is from the run it led
    after = slow_mesh.gateway_counters()
    assert int(after["coalesced_reruns"]) - int(before["coalesced_reruns"]) == 1  # it joined
    assert int(after["inferences"]) - int(before["inferences"]) == 2


def test_cache_killed_mid_run_fails_open_then_recovers(slow_mesh: Mesh) -> None:
    # An exact-only model: every distinct text is a miss held 300 ms in inference, so the
    # kill lands while most of the requests are still to come.
    texts = [f"request {i}: can I change my delivery address" for i in range(24)]
    with ThreadPoolExecutor(4) as pool:
        running = pool.map(lambda t: ask(slow_mesh, t, tenant="fo", model="short"), texts)
        time.sleep(0.5)
        slow_mesh.kill("cache")
        replies = list(running)  # every request must succeed: the cache is optional
    assert all(r.prediction.label for r in replies)
    assert replies[-1].cache.outcome == FAIL_OPEN
    after_kill = [ask(slow_mesh, t, tenant="fo", model="short") for t in texts[:5]]
    assert all(r.cache.outcome == FAIL_OPEN for r in after_kill)
    counters = slow_mesh.gateway_counters()
    assert counters["circuit"] == "open" or int(counters["cache_circuit_opened"]) >= 1
    assert int(counters["cache_circuit_open"]) >= 1, counters  # calls skipped while open
    assert any("circuit open" in r.cache.detail for r in after_kill)

    slow_mesh.start(("cache",))
    deadline = time.monotonic() + 30
    while (
        reply := ask(slow_mesh, "a fresh question after recovery", tenant="fo")
    ).cache.outcome == FAIL_OPEN:
        assert time.monotonic() < deadline, reply.cache.detail
        time.sleep(0.5)
    assert slow_mesh.gateway_counters()["circuit"] == "closed"


def test_a_restarted_cache_is_used_again_before_the_circuits_cool_down_ends(
    default_repo: Path, tmp_path: Path
) -> None:
    """The circuit opened because the cache was unreachable: once the gateway connects to it
    again, the next lookup is the circuit's probe. Before, a restarted cache was skipped
    until the cool-down ended (FAIL_OPEN 2-6 s after it served again with the default 5 s;
    here 120 s, so the old behaviour cannot pass by chance). A cache that answers but fails
    (UNAVAILABLE from the cache itself, Milvus down) keeps its full cool-down: unit tests."""
    mesh = Mesh(
        make_repo(default_repo, tmp_path),
        tmp_path,
        HOPLINE_DEFAULT_MODEL="sem",
        HOPLINE_CACHE_BREAKER_FAILURES="2",
        HOPLINE_CACHE_BREAKER_COOLDOWN_S="120",
        HOPLINE_CACHE_BUDGET_MS="2000",
    ).start()
    try:
        mesh.kill("cache")
        down = [ask(mesh, f"is the cache away {i}", tenant="back") for i in range(4)]
        assert all(r.cache.outcome == FAIL_OPEN for r in down)
        assert "circuit open" in down[-1].cache.detail
        mesh.start(("cache",))
        deadline = time.monotonic() + 30
        while (reply := ask(mesh, "is the cache back", tenant="back")).cache.outcome == FAIL_OPEN:
            assert "circuit open" in reply.cache.detail or "unavailable" in (
                reply.cache.detail.lower()
            ), reply.cache.detail
            assert time.monotonic() < deadline, reply.cache.detail
            time.sleep(0.2)
        assert reply.cache.outcome in (MISS, SEMANTIC), reply.cache
        assert mesh.gateway_counters()["circuit"] == "closed"
    finally:
        mesh.stop()


def test_refresh_replaces_the_entry_and_bypass_leaves_the_cache_alone(cmesh: Mesh) -> None:
    text = "what are your opening hours"
    ask(cmesh, text, tenant="modes")
    cmesh.settle()
    first = ask(cmesh, text, tenant="modes")
    assert first.cache.outcome == EXACT
    time.sleep(0.3)
    refreshed = ask(cmesh, text, tenant="modes", cache_mode="refresh")
    assert refreshed.cache.outcome == common_pb2.CACHE_OUTCOME_SKIPPED
    assert "REFRESH" in refreshed.cache.detail
    cmesh.settle()
    again = ask(cmesh, text, tenant="modes")
    assert again.cache.outcome == EXACT
    assert again.cache.entry_id == first.cache.entry_id  # same key, new entry
    assert again.cache.age_s < first.cache.age_s + 0.3  # written by the refresh, not before
    stores = cmesh.gateway_counters()["stores"]
    bypass = ask(cmesh, "a question nobody asked before", tenant="modes", cache_mode="bypass")
    assert bypass.cache.outcome == common_pb2.CACHE_OUTCOME_SKIPPED
    cmesh.settle()
    assert cmesh.gateway_counters()["stores"] == stores
    assert lookup(cmesh, "a question nobody asked before", "modes", "sem") == MISS
