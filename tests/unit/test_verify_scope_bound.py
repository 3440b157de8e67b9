"""The verifier keeps at most MAX_SCOPES scopes (cache/verify.py:Rules): without API keys a
caller names its tenant, and each tenant's scope, its policy and its
`hopline_cache_verify_threshold` series were kept for good, and its rows in the SQLite
evidence file too (a soak probe: 0 -> 1,301 series for 1,300 tenant names, still there after
every entry was invalidated). The least recently used scope is forgotten: its share of the
series removed, its rows dropped, and used again it starts from its prior. The series is a
model version's, the lowest of its scopes' thresholds: by tenant, it named every tenant on
/metrics, which takes no key (a security probe)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from prometheus_client import REGISTRY

from hopline.cache.evidence import EvidenceLog, Noted
from hopline.cache.verifier import Verifier
from hopline.cache.verify import Decision, Observation, Rules, VerifyPolicy, scope_key
from hopline.protos.hopline.common.v1 import common_pb2

POLICY = VerifyPolicy(target=0.01, confidence=0.9, prior_threshold=0.85, floor=0.55)


def scope(tenant: str, model: str = "") -> tuple[str, str, str, str]:
    """A tenant's scope of `model` (by default a model of its own, a series of its own)."""
    return (tenant, model or f"bounded-model-{tenant}", "1", "{}")


def series(tenant: str, model: str = "") -> float | None:
    return REGISTRY.get_sample_value(
        "hopline_cache_verify_threshold",
        {"model": model or f"bounded-model-{tenant}", "model_version": "1"},
    )


def test_the_series_is_a_model_versions_lowest_threshold_and_names_no_tenant() -> None:
    verifier = Verifier(seed=1)
    cached = common_pb2.Prediction(label="x")
    stricter = dataclasses.replace(POLICY, prior_threshold=0.9)
    verifier.decide(scope("acme", "shared-model"), cached, 0.5, POLICY, "")
    verifier.decide(scope("globex", "shared-model"), cached, 0.5, stricter, "")
    assert series("", "shared-model") == POLICY.prior_threshold  # the lower of the two
    verifier.rules.forgotten.append(scope_key(scope("acme", "shared-model")))
    verifier._drop_forgotten()
    assert series("", "shared-model") == stricter.prior_threshold
    names = {
        key
        for metric in REGISTRY.collect()
        if metric.name == "hopline_cache_verify_threshold"
        for sample in metric.samples
        for key in sample.labels
    }
    assert names == {"model", "model_version"}


def test_the_least_recently_used_scope_is_forgotten() -> None:
    rules = Rules(seed=1, max_scopes=2)
    for tenant in ("a", "b"):
        rules.decide(tenant, "x", 0.9, POLICY)
    rules.decide("a", "x", 0.9, POLICY)  # used again: "b" is now the oldest
    rules.decide("c", "x", 0.9, POLICY)
    assert list(rules.scopes) == ["a", "c"]
    assert rules.forgotten == ["b"]


def test_a_verifier_forgets_a_scopes_series_and_its_rows(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int]:
        verifier = Verifier(seed=1)
        verifier.rules.max_scopes = 3
        path = tmp_path / "evidence.sqlite"
        await verifier.start(lambda: EvidenceLog(path), str(path))
        cached = common_pb2.Prediction(label="x")
        for i in range(10):
            decision, _, _ = verifier.decide(scope(f"t{i}"), cached, 0.9, POLICY, "")
            assert decision in (Decision.SERVE_AND_VERIFY, Decision.VERIFY_FIRST)
            observed = Observation(0.9, True, 1.0, stratum="", at=time.time())
            await verifier._keep([Noted("", scope_key(scope(f"t{i}")), "x", observed)])
        await verifier._tidy()
        assert verifier.store is not None
        kept = len(verifier.store.replay())
        await verifier.stop()
        return kept, len(verifier.rules.scopes)

    kept_rows, kept_scopes = asyncio.run(scenario())
    assert kept_scopes == 3
    assert kept_rows == 3  # the forgotten scopes' rows are gone from the file
    assert [series(f"t{i}") is not None for i in range(10)] == [False] * 7 + [True] * 3


def test_the_evidence_file_keeps_only_the_windows(tmp_path: Path) -> None:
    """Kept whole, the file grew with every comparison for good; the replay reads only each
    (scope, stratum)'s window, so what left it is dropped."""
    log = EvidenceLog(tmp_path / "evidence.sqlite")
    key = scope_key(scope("w"))
    log.append(
        [
            Noted("", key, "x", Observation(0.9, True, 1.0, stratum="", at=100.0 + t))
            for t in range(10)
        ]
    )
    log.trim({(key, ""): 106.0})  # the window's oldest observation was made at 106
    assert [n.obs.at for n in log.replay()] == [106.0, 107.0, 108.0, 109.0]
    log.close()
