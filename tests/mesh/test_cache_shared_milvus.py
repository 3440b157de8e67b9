"""Two cache replicas over one Milvus server, reached by URI (http://127.0.0.1:PORT).

Replica A belongs to a whole mesh; replica B and a second gateway share A's tokenizer,
inference and postprocess, so each gateway watches a different cache replica. The server is
milvus-lite's own (always installed), or the Milvus standalone with HOPLINE_TEST_MILVUS=standalone
(`make milvus-server-tests`). Everything is a real process on a loopback port.

What must hold (cache/shared_invalidations.py):
- a store through one replica is served by the other once its batched write lands (an
  exact-index miss reads Milvus by key), as an EXACT hit;
- an invalidation through either replica stops the other from serving the entries from its
  exact index, and reaches every gateway's local exact tier, within the shared log's poll;
- a verify_id one replica issued is taken by the other (a load balancer's choice), and the
  evidence reaches both replicas' rules and survives a replica's restart
  (cache/verify_ids.py, cache/shared_evidence.py).
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from milvus_server import MilvusKind, MilvusServer, chosen_kind, lane_env

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

LOCAL = "answered by the gateway's local exact tier"
EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS
POLL_MS = 100  # HOPLINE_CACHE_PEER_POLL_MS for both replicas
WAIT_S = 30.0  # how long a test waits for what must happen (a loaded CI machine is slow)

Replicas = tuple[Mesh, Mesh]


@pytest.fixture(scope="module")
def replicas(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    work = tmp_path_factory.mktemp("shared-milvus")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    kind = chosen_kind()
    server = MilvusServer(
        work / "milvus", MilvusKind.LITE_SERVER if kind is MilvusKind.FILE else kind
    )
    poll = str(POLL_MS)
    gateway_env = {"gateway": lane_env(server.kind)}
    (work / "a").mkdir()
    (work / "b").mkdir()
    a = Mesh(
        repo,
        work / "a",
        service_env=gateway_env,
        HOPLINE_CACHE_URI=server.uri,
        HOPLINE_CACHE_PEER_POLL_MS=poll,
    )
    b = Mesh(
        repo,
        work / "b",
        service_env=gateway_env,
        addrs={name: a.addrs[name] for name in ("tokenizer", "inference", "postprocess")},
        HOPLINE_CACHE_URI=server.uri,
        HOPLINE_CACHE_PEER_POLL_MS=poll,
    )
    try:
        server.start()
        a.start()
        b.start(names=("cache", "gateway"))
        yield a, b
    finally:
        b.stop()
        a.stop()
        server.stop()


def predict(mesh: Mesh, text: str, tenant: str) -> gateway_pb2.PredictResponse:
    with grpc.insecure_channel(mesh.gateway) as channel:
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text=text, tenant=tenant), timeout=30
        )
    return reply


def invalidate(mesh: Mesh, request: cache_pb2.InvalidateRequest) -> int:
    with grpc.insecure_channel(mesh.addrs["cache"]) as channel:
        reply = cache_pb2_grpc.CacheServiceStub(channel).Invalidate(request, timeout=10)
    return int(reply.removed)


@contextlib.contextmanager
def cache_stubs(
    replicas: Replicas,
) -> Iterator[tuple[cache_pb2_grpc.CacheServiceStub, cache_pb2_grpc.CacheServiceStub]]:
    """Stubs straight to replica A's and replica B's cache services."""
    a, b = replicas
    with (
        grpc.insecure_channel(a.addrs["cache"]) as chan_a,
        grpc.insecure_channel(b.addrs["cache"]) as chan_b,
    ):
        yield cache_pb2_grpc.CacheServiceStub(chan_a), cache_pb2_grpc.CacheServiceStub(chan_b)


def waited(condition: Callable[[], bool], what: str) -> float:
    """Seconds until `condition` held (polled every 10 ms); fails after WAIT_S."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > WAIT_S:
            raise AssertionError(f"{what}: not within {WAIT_S} s")
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_store_through_one_replica_is_served_by_the_other(replicas: Replicas) -> None:
    a, b = replicas
    text = "my parcel says delivered but nothing arrived"
    first = predict(a, text, "shared-store")
    assert first.cache.outcome == MISS
    a.settle()  # the store reached Milvus through replica A
    served = predict(b, text, "shared-store")
    assert served.cache.outcome == EXACT
    assert served.cache.detail != LOCAL  # from replica B's Milvus read, not a local copy
    assert served.prediction == first.prediction


def test_store_visibility_time_is_the_batched_write(
    replicas: Replicas, figures: Callable[[str], None]
) -> None:
    """Store straight to replica A, then look up at B until it answers: reported, not bound."""
    with cache_stubs(replicas) as (stub_a, stub_b):
        scope = common_pb2.Scope(tenant="shared-visibility", model=DEFAULT_MODEL, model_version="1")
        seen = []
        for i in range(5):
            text = f"visibility probe number {i} for the shared store"
            lookup = cache_pb2.LookupRequest(scope=scope, text=text, mode="exact")
            assert stub_b.Lookup(lookup, timeout=10).outcome == MISS
            stub_a.Store(
                cache_pb2.StoreRequest(
                    scope=scope,
                    text=text,
                    mode="exact",
                    prediction=common_pb2.Prediction(label="x"),
                ),
                timeout=10,
            )
            # An exact-mode lookup reads Milvus on an index miss only with fallback 'all'; a
            # semantic-mode one (the default model's policy) does with the default 'semantic'.
            semantic = cache_pb2.LookupRequest(
                scope=scope, text=text, mode="semantic", threshold=1.0
            )
            hit = functools.partial(answers, stub_b, semantic, EXACT)
            seen.append(waited(hit, "replica B serving replica A's store"))
    figures(f"store at A -> EXACT at B, seconds: {[round(s, 3) for s in seen]}")


def test_a_semantic_store_through_one_replica_is_found_by_the_others_search(
    replicas: Replicas,
) -> None:
    """Over a Milvus server a replica's semantic search goes to Milvus, not to the vectors it
    holds in memory (those are only its own stores: cache/vector_index.py)."""
    with cache_stubs(replicas) as (stub_a, stub_b):
        scope = common_pb2.Scope(tenant="shared-semantic", model=DEFAULT_MODEL, model_version="1")
        stub_a.Store(
            cache_pb2.StoreRequest(
                scope=scope,
                text="my card was stolen",
                mode="semantic",
                prediction=common_pb2.Prediction(label="card_stolen"),
            ),
            timeout=10,
        )
        paraphrase = cache_pb2.LookupRequest(
            scope=scope, text="someone stole my card", mode="semantic", threshold=0.8
        )
        hit = functools.partial(answers, stub_b, paraphrase, common_pb2.CACHE_OUTCOME_SEMANTIC)
        waited(hit, "replica B's search finding replica A's semantic store")
        assert stub_b.Lookup(paraphrase, timeout=10).prediction.label == "card_stolen"


def answers(
    stub: cache_pb2_grpc.CacheServiceStub,
    request: cache_pb2.LookupRequest,
    outcome: common_pb2.CacheOutcome.ValueType,
) -> bool:
    return bool(stub.Lookup(request, timeout=10).outcome == outcome)


def local_copy(mesh: Mesh, text: str, tenant: str) -> bool:
    return predict(mesh, text, tenant).cache.detail == LOCAL


def test_an_invalidation_through_either_replica_reaches_both_gateways(
    replicas: Replicas, figures: Callable[[str], None]
) -> None:
    a, b = replicas
    tenant = "shared-inval"
    texts = {"stored-by-b": "how do I close my account", "stored-by-a": "update my billing address"}
    predict(b, texts["stored-by-b"], tenant)  # into replica B's exact index
    b.settle()
    predict(a, texts["stored-by-a"], tenant)
    a.settle()
    for text in texts.values():
        for mesh in (a, b):
            # The first repeat copies the cache's EXACT hit, the next is answered locally.
            waited(functools.partial(local_copy, mesh, text, tenant), "a local copy")
    entry = predict(b, texts["stored-by-a"], tenant).cache.entry_id

    # By id through replica B: replica A's index and gateway A's copy must drop it.
    held_a = int(a.gateway_counters()["local_exact_entries"])
    started = time.monotonic()
    assert invalidate(b, cache_pb2.InvalidateRequest(entry_ids=[entry])) >= 1
    waited(
        lambda: int(a.gateway_counters()["local_exact_entries"]) == held_a - 1,
        "gateway A dropping an entry invalidated through replica B",
    )
    by_id_s = time.monotonic() - started
    # Replica A's index held it (A stored it): A must not answer it now.
    assert predict(a, texts["stored-by-a"], tenant).cache.outcome == MISS
    a.settle()

    # By scope through replica A: replica B's index held this entry from its own store.
    assert local_copy(b, texts["stored-by-b"], tenant)
    started = time.monotonic()
    assert invalidate(a, cache_pb2.InvalidateRequest(scope=common_pb2.Scope(tenant=tenant))) >= 1
    replies: list[gateway_pb2.PredictResponse] = []

    def not_local() -> bool:
        replies.append(predict(b, texts["stored-by-b"], tenant))
        return replies[-1].cache.detail != LOCAL

    waited(not_local, "gateway B dropping a scope invalidated through replica A")
    by_scope_s = time.monotonic() - started
    # The first answer not from gateway B's copy: replica B's index must not hold it either.
    assert replies[-1].cache.outcome == MISS
    figures(
        f"invalidation -> other gateway's copy dropped: by id {by_id_s:.3f} s, "
        f"by scope {by_scope_s:.3f} s (poll {POLL_MS} ms)"
    )


def verified_lookup_request(tenant: str) -> cache_pb2.LookupRequest:
    return cache_pb2.LookupRequest(
        scope=common_pb2.Scope(tenant=tenant, model=DEFAULT_MODEL, model_version="1"),
        text="someone stole my card",
        mode="semantic",
        threshold=0.7,
        verify_target=0.01,
        verify_confidence=0.9,
    )


def verified_lookup(stub: cache_pb2_grpc.CacheServiceStub, tenant: str) -> cache_pb2.LookupResponse:
    reply: cache_pb2.LookupResponse = stub.Lookup(verified_lookup_request(tenant), timeout=10)
    return reply


def rule_of(mesh: Mesh, tenant: str) -> cache_pb2.VerifyRule | None:
    rules = [r for r in mesh.cache_stats().verify_rules if r.scope.tenant == tenant]
    return rules[0] if rules else None


def test_a_verify_id_is_taken_by_either_replica_and_both_learn_from_it(
    replicas: Replicas,
) -> None:
    """Runs last in this module: it restarts replica B's cache. Before the shared store, the
    report at B was NOT_FOUND ("no verification pending") and A never learnt."""
    a, b = replicas
    tenant = "verified-shared"
    with cache_stubs(replicas) as (stub_a, stub_b):
        stub_a.Store(
            cache_pb2.StoreRequest(
                scope=common_pb2.Scope(tenant=tenant, model=DEFAULT_MODEL, model_version="1"),
                text="my card was stolen",
                mode="semantic",
                prediction=common_pb2.Prediction(label="card_stolen"),
            ),
            timeout=10,
        )
        waited(
            lambda: answers(
                stub_a, verified_lookup_request(tenant), common_pb2.CACHE_OUTCOME_SEMANTIC
            ),
            "replica A's search finding its own semantic store",
        )
        issued = verified_lookup(stub_a, tenant)
        assert issued.outcome == common_pb2.CACHE_OUTCOME_SEMANTIC
        assert issued.verify_id  # nothing known yet: every served hit is checked
        # The model disagrees, and the report reaches replica B.
        reported = stub_b.ReportVerification(
            cache_pb2.ReportVerificationRequest(
                verify_id=issued.verify_id, prediction=common_pb2.Prediction(label="card_lost")
            ),
            timeout=10,
        )
        assert not reported.agreed
        # Replica A learns it from B's evidence: the answer is held back there too.
        waited(lambda: (rule_of(a, tenant) or cache_pb2.VerifyRule()).disagreements == 1, "A")
        url = f"http://127.0.0.1:{a.metrics_ports['cache']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as scraped:
            assert re.search(
                rb'^hopline_cache_verify_evidence_total\{event="read_from_peers"\} [1-9]',
                scraped.read(),
                re.MULTILINE,
            )
        held = verified_lookup(stub_a, tenant)
        assert held.outcome == common_pb2.CACHE_OUTCOME_MISS
        assert held.verify_id  # still a candidate: its comparison is evidence
        # The id counts as reported on A as well.
        with pytest.raises(grpc.RpcError) as again:
            stub_a.ReportVerification(
                cache_pb2.ReportVerificationRequest(
                    verify_id=issued.verify_id,
                    prediction=common_pb2.Prediction(label="card_lost"),
                ),
                timeout=10,
            )
        assert again.value.code() == grpc.StatusCode.NOT_FOUND
        assert "reported already" in (again.value.details() or "")

    # A replica replaced (a pod in a rollout, with an empty disk) starts from the evidence.
    assert b.terminate("cache") == 0
    b.start(names=("cache",))
    with cache_stubs(replicas) as (_, stub_b):
        assert verified_lookup(stub_b, tenant).outcome == common_pb2.CACHE_OUTCOME_MISS
    rule = rule_of(b, tenant)  # GetStats lists the scopes looked up since the start
    assert rule is not None
    assert (rule.observations, rule.disagreements) == (1, 1)
