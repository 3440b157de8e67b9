"""`hopline cache eval`: what the semantic cache does to a labelled workload, end to end.

Warm the cache with a data set's store split through the gateway (as traffic would), then
send every query twice: once with the cache (USE) and once without (BYPASS, the model's own
answer and latency). A hit whose label differs from the model's own answer for that query is
a cache-induced error: the cache changed what the user would have been told. Queries run
one at a time so their latencies are not queueing artefacts; warm-up runs concurrently.

Each run uses a fresh tenant, so earlier runs' entries never count (tenants never share).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hopline.cache.evaluation_report import markdown, summarise
from hopline.cache.keys import answer_parameters, exact_key, scope_tuple
from hopline.model.repository import CachePolicy
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.tls import aio_channel, operator_tls

Examples = list[tuple[str, str]]
OUTCOMES = {
    common_pb2.CACHE_OUTCOME_EXACT: "exact",
    common_pb2.CACHE_OUTCOME_SEMANTIC: "semantic",
    common_pb2.CACHE_OUTCOME_MISS: "miss",
    common_pb2.CACHE_OUTCOME_FAIL_OPEN: "fail_open",
    common_pb2.CACHE_OUTCOME_SKIPPED: "skipped",
}


@dataclasses.dataclass
class Query:
    text: str
    label: str  # ground truth
    oos: bool
    outcome: str = ""
    cached_label: str = ""
    similarity: float = 0.0
    from_store_split: bool = False  # the hit's entry was written by the warm-up
    model_label: str = ""
    model_score: float = 0.0
    total_ms: float = 0.0  # client-side, with the cache
    lookup_ms: float = 0.0  # the gateway's cache hop
    model_total_ms: float = 0.0  # client-side, cache bypassed
    inference_ms: float = 0.0  # the gateway's inference hop, cache bypassed


# The splits `evaluate` reads: stored texts, in-scope queries, out-of-scope queries.
EVAL_SPLITS = ("train", "test", "oos_test")


def load_clinc(path: Path, max_intents: int = 0) -> dict[str, Examples]:
    """CLINC150's data_full.json layout; ValueError naming the file and what is wrong (the
    command's one line) for a file that is not it."""
    expected = f"a JSON object of splits {', '.join(EVAL_SPLITS)}: lists of [text, label]"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"--clinc {path}: expected {expected}: {exc}") from exc
    if not isinstance(raw, dict) or any(k not in raw for k in EVAL_SPLITS):
        has = ", ".join(raw) if isinstance(raw, dict) else f"a {type(raw).__name__}"
        raise ValueError(f"--clinc {path}: expected {expected}; it has {has or 'none'}")
    try:
        splits = {k: [(str(t), str(lab)) for t, lab in v] for k, v in raw.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--clinc {path}: expected {expected}: a row {exc}") from exc
    # A negative count sliced sorted(labels)[:-1]: all intents but one, and still the
    # out-of-scope share cut, a subset nobody asked for.
    if max_intents < 0:
        raise ValueError(f"--max-intents must be 0 (all) or more, got {max_intents}")
    if max_intents:
        keep = sorted({lab for _, lab in splits["train"]})[:max_intents]
        splits = {
            k: [(t, lab) for t, lab in v if lab in keep or lab == "oos"] for k, v in splits.items()
        }
        # Keep the in-scope to out-of-scope ratio of the full set for the queries.
        share = max_intents / len({lab for _, lab in raw["train"]})
        splits["oos_test"] = splits["oos_test"][: max(1, int(len(splits["oos_test"]) * share))]
    return splits


def _timing(reply: gateway_pb2.PredictResponse, hop: str) -> float:
    return next((t.ms for t in reply.timings if t.hop == hop), 0.0)


class Evaluation:
    def __init__(self, gateway: str, cache: str, model: str, version: str, tenant: str) -> None:
        self.gateway = gateway
        self.cache = cache
        self.model = model
        self.tenant = tenant
        self.version = version
        self.digest = ""  # the version's files' fingerprint, from the first reply

    async def _predict(
        self,
        stub: gateway_pb2_grpc.GatewayServiceAsyncStub,
        text: str,
        mode: common_pb2.CacheMode.ValueType,
    ) -> tuple[gateway_pb2.PredictResponse, float]:
        started = time.perf_counter()
        reply = await stub.Predict(
            gateway_pb2.PredictRequest(
                text=text,
                model=self.model,
                model_version=self.version,
                tenant=self.tenant,
                cache_mode=mode,
            ),
            timeout=60,
        )
        return reply, (time.perf_counter() - started) * 1e3

    async def warm(self, texts: Sequence[str], concurrency: int) -> dict[str, int]:
        """Send every text with the cache; the outcomes' counts sum to the texts sent."""
        # No workers would send nothing, and the report would still claim a warm cache.
        if concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
        outcomes: dict[str, int] = {}
        async with aio_channel(self.gateway, operator_tls("gateway")) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            queue = list(texts)

            async def worker() -> None:
                while queue:
                    reply, _ = await self._predict(stub, queue.pop(), common_pb2.CACHE_MODE_USE)
                    self.version, self.digest = reply.model_version, reply.model_digest
                    name = OUTCOMES.get(reply.cache.outcome, "other")
                    outcomes[name] = outcomes.get(name, 0) + 1

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        await self.settle()
        return outcomes

    async def settle(self, timeout_s: float = 120.0) -> None:
        """Until every store the warm-up caused is written: hits must not depend on timing."""
        deadline = time.monotonic() + timeout_s
        async with (
            aio_channel(self.gateway, operator_tls("gateway")) as gw,
            aio_channel(self.cache, operator_tls("cache")) as cc,
        ):
            gstub, cstub = (
                gateway_pb2_grpc.GatewayServiceStub(gw),
                cache_pb2_grpc.CacheServiceStub(cc),
            )
            while time.monotonic() < deadline:
                g = await gstub.GetStats(gateway_pb2.GetStatsRequest(), timeout=10)
                c = await cstub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
                if g.counters["stores_in_flight"] == 0 and c.pending_writes == 0:
                    return
                await asyncio.sleep(0.1)
        raise TimeoutError(f"cache writes still pending after {timeout_s:.0f}s")

    async def query(
        self, queries: list[Query], store_keys: set[str], *, bypass: bool = True
    ) -> None:
        """Each query with the cache, then (with `bypass`) without it for the model's own
        answer; without `bypass` the queries carry the model's answer already."""
        async with aio_channel(self.gateway, operator_tls("gateway")) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for q in queries:
                reply, q.total_ms = await self._predict(stub, q.text, common_pb2.CACHE_MODE_USE)
                q.outcome = OUTCOMES.get(reply.cache.outcome, "other")
                q.cached_label = reply.prediction.label
                q.similarity = reply.cache.similarity
                q.from_store_split = reply.cache.entry_id in store_keys
                q.lookup_ms = _timing(reply, "cache_lookup")
                if not bypass:
                    continue
                own, q.model_total_ms = await self._predict(
                    stub, q.text, common_pb2.CACHE_MODE_BYPASS
                )
                q.model_label = own.prediction.label
                q.model_score = own.prediction.score
                q.inference_ms = _timing(own, "inference")

    async def cache_stats(self) -> cache_pb2.GetStatsResponse:
        async with aio_channel(self.cache, operator_tls("cache")) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            reply: cache_pb2.GetStatsResponse = await stub.GetStats(
                cache_pb2.GetStatsRequest(), timeout=10
            )
            return reply

    async def repeat(self, texts: Sequence[str]) -> list[tuple[str, float, float]]:
        """Send texts again once their stores have landed: (outcome, lookup ms, total ms)."""
        await self.settle()
        out: list[tuple[str, float, float]] = []
        async with aio_channel(self.gateway, operator_tls("gateway")) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for text in texts:
                reply, total = await self._predict(stub, text, common_pb2.CACHE_MODE_USE)
                outcome = OUTCOMES.get(reply.cache.outcome, "other")
                out.append((outcome, _timing(reply, "cache_lookup"), total))
        return out


def _verification(
    before: cache_pb2.GetStatsResponse,
    warmed: cache_pb2.GetStatsResponse,
    after: cache_pb2.GetStatsResponse,
    tenant: str,
    policy: CachePolicy,
) -> dict[str, Any]:
    """What verification did and cost, warm-up and queries apart (the cache's counters; only
    the verified pass's model has a verify_target, so the deltas are that pass's)."""

    def delta(a: cache_pb2.GetStatsResponse, b: cache_pb2.GetStatsResponse) -> dict[str, int]:
        return {
            "candidates": b.verify_candidates - a.verify_candidates,
            "verified": b.verified - a.verified,
            "disagreements": b.disagreements - a.disagreements,
            "verified_after_reply": b.verified_after_reply - a.verified_after_reply,
        }

    rule = next((r for r in after.verify_rules if r.scope.tenant == tenant), None)
    return {
        "target": policy.verify_target,
        "confidence": policy.verify_confidence,
        "warm_up": delta(before, warmed),
        "queries": delta(warmed, after),
        "rule": None
        if rule is None
        else {
            "threshold": round(rule.threshold, 4),
            "learned": rule.learned,
            "observations": rule.observations,
            "disagreements": rule.disagreements,
            "held_back": rule.held_back,
        },
    }


def _pass(
    ev: Evaluation,
    store: list[str],
    queries: list[Query],
    concurrency: int,
    *,
    bypass: bool,
) -> tuple[dict[str, int], float, float, set[str]]:
    """Warm with `store`, then send `queries`: (warm outcomes, warm s, query s, warm keys)."""
    started = time.perf_counter()
    warm = asyncio.run(ev.warm(store, concurrency))
    warm_s = time.perf_counter() - started
    store_keys = _keys(ev, store)
    asyncio.run(ev.query(queries, store_keys, bypass=bypass))
    return warm, warm_s, time.perf_counter() - started - warm_s, store_keys


def _keys(ev: Evaluation, store: list[str]) -> set[str]:
    """Entry ids are exact keys over the gateway's scope: which hits the warm-up wrote."""
    scope = scope_tuple(
        common_pb2.Scope(
            tenant=ev.tenant,
            model=ev.model,
            model_version=ev.version,
            parameters=answer_parameters(1, ev.digest),
        )
    )
    return {exact_key(scope, t) for t in store}


def run(
    clinc: Path,
    *,
    gateway: str,
    cache: str,
    model: str,
    policy: CachePolicy,
    model_version: str = "",
    verified_model: str = "",
    verified_policy: CachePolicy | None = None,
    max_intents: int = 0,
    concurrency: int = 2,
    exact_repeats: int = 500,
    seed: int = 0,
    out_dir: Path | None = None,
    labels: Sequence[str] = (),
) -> dict[str, Any]:
    """The static pass (`model`), then, with `verified_model` (the same model with a
    verify_target), the verified pass on the same texts in the same order."""
    # Said before the warm-up's minutes, not after: stored_misses[:-5] resent all but five.
    if exact_repeats < 0:
        raise ValueError(f"--exact-repeats must be 0 or more, got {exact_repeats}")
    if concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    splits = load_clinc(clinc, max_intents)
    intents = {lab for _, lab in splits["train"]}
    if labels and not intents & set(labels):
        # Said before the warm-up: a model trained on other intents scored 0.00% with and
        # without the cache, exit 0, and left its warm-up entries behind (an operator's probe).
        raise ValueError(
            f"none of the {len(intents)} intents of {clinc} (after --max-intents) is a label of "
            f"model {model!r} ({len(labels)} labels, such as {sorted(labels)[0]!r}): evaluate "
            "a model built from this data (hopline model build --train ...)"
        )
    # Shuffled (seeded): the splits are grouped by intent, which would flatter a rule that
    # learns online (each intent's evidence would arrive in one burst).
    rng = random.Random(seed)
    store = [t for t, _ in splits["train"]]
    rng.shuffle(store)
    rows = [(t, lab, False) for t, lab in splits["test"]]
    rows += [(t, lab, True) for t, lab in splits["oos_test"]]
    rng.shuffle(rows)
    stamp = int(time.time() * 1000)
    ev = Evaluation(gateway, cache, model, model_version, f"eval-{stamp}")
    queries = [Query(*row) for row in rows]
    warm, warm_s, query_s, _ = _pass(ev, store, queries, concurrency, bypass=True)
    # The queries hardly repeat each other, so exact hits are measured apart: resend texts
    # whose misses were stored. They are not counted in the hit rate.
    stored_misses = [
        q.text
        for q in queries
        if q.outcome == "miss"
        and q.model_score >= policy.min_score
        and (policy.store_out_of_scope or q.model_label != "out_of_scope")
    ]
    repeats = asyncio.run(ev.repeat(stored_misses[:exact_repeats])) if exact_repeats else []
    meta = {
        "model": model,
        "model_version": ev.version,
        "threshold": policy.threshold,
        "min_score": policy.min_score,
        "seed": seed,
        # What the warm-up sent (each text's outcome counted), not what it was given.
        "warmed": sum(warm.values()),
        "max_intents": max_intents,
    }
    report = summarise(
        queries,
        {
            **meta,
            "mode": "static",
            "tenant": ev.tenant,
            "warm_outcomes": warm,
            "warm_seconds": round(warm_s, 1),
            "query_seconds": round(query_s, 1),
            "repeats": repeats,
        },
    )
    if verified_model:
        assert verified_policy is not None
        report["verified"] = _verified_pass(
            gateway, cache, verified_model, verified_policy, store, queries, concurrency, meta
        )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cache-eval.json").write_text(json.dumps(report, indent=1) + "\n")
        (out_dir / "cache-eval.md").write_text(markdown(report))
    return report


def _verified_pass(
    gateway: str,
    cache: str,
    model: str,
    policy: CachePolicy,
    store: list[str],
    static: list[Query],
    concurrency: int,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The same warm-up and queries through the verified model, one request per query: the
    model's own answer is the static pass's (the same weights answer the same text alike)."""
    tenant = f"eval-{int(time.time() * 1000)}-verified"
    ev = Evaluation(gateway, cache, model, "", tenant)
    queries = [
        Query(q.text, q.label, q.oos, model_label=q.model_label, model_score=q.model_score)
        for q in static
    ]
    for q, s in zip(queries, static, strict=True):
        q.model_total_ms, q.inference_ms = s.model_total_ms, s.inference_ms
    before = asyncio.run(ev.cache_stats())
    started = time.perf_counter()
    warm = asyncio.run(ev.warm(store, concurrency))
    warm_s = time.perf_counter() - started
    warmed = asyncio.run(ev.cache_stats())
    asyncio.run(ev.query(queries, _keys(ev, store), bypass=False))
    query_s = time.perf_counter() - started - warm_s
    asyncio.run(ev.settle())  # the last reports land before the counters are read
    after = asyncio.run(ev.cache_stats())
    report = summarise(
        queries,
        {
            **meta,
            "mode": "verified",
            "model": model,
            "tenant": tenant,
            "warmed": sum(warm.values()),  # this pass's own warm-up, not the static one's
            "warm_outcomes": warm,
            "warm_seconds": round(warm_s, 1),
            "query_seconds": round(query_s, 1),
        },
    )
    report["verification"] = _verification(before, warmed, after, tenant, policy)
    return report
