"""The cache service's side of verified hits: decisions, pending comparisons, evidence on disk.

`cache/verify.py` holds the rule; this module applies it to lookups. A lookup whose request
carries the model's `verify_target` has its best semantic candidate (past the unseen-parts
check and the runner-up agreement rule) decided by the scope's rule. SERVE_AND_VERIFY and
VERIFY_FIRST get a `verify_id`: the caller reports the model's answer for that id with
ReportVerification, the two answers are compared (the same label: the classifier's equality
rule) and the result becomes evidence, appended to the SQLite log beside the Milvus data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import secrets
import time
from collections import OrderedDict
from pathlib import Path

from opentelemetry import trace

from hopline.cache.store import Entry
from hopline.cache.verify import (
    Decision,
    EvidenceLog,
    Observation,
    Rules,
    VerifyPolicy,
    scope_key,
    stratum,
)
from hopline.observability import metrics, schema
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.cache.verify")

PENDING_MAX = 100_000  # comparisons awaited at once; the oldest are dropped past it
PENDING_TTL_S = 300.0  # an id not reported by then is forgotten
LEARN_SPAN = 0.3  # candidates this far below the static threshold are still learned from


@dataclasses.dataclass(frozen=True)
class Pending:
    scope: tuple[str, str, str, str]
    region: str  # the candidate's answer
    stratum: str  # its runner-ups' agreement (cache/verify.py:stratum)
    similarity: float
    weight: float
    policy: VerifyPolicy
    created: float


def policy_of(request: cache_pb2.LookupRequest) -> VerifyPolicy | None:
    """The request's verification settings, or None for a static threshold. Raises
    ValueError with a message for the caller when they are out of range."""
    if request.verify_target == 0:
        return None
    if not 0.0 < request.verify_target < 1.0:
        raise ValueError(f"verify_target must be in (0, 1), got {request.verify_target}")
    confidence = request.verify_confidence or 0.9
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"verify_confidence must be in (0, 1), got {confidence}")
    threshold = float(request.threshold)
    return VerifyPolicy(
        target=request.verify_target,
        confidence=confidence,
        prior_threshold=threshold,
        floor=max(0.0, threshold - LEARN_SPAN),
    )


def same_answer(cached: common_pb2.Prediction, fresh: common_pb2.Prediction) -> bool:
    """The classifier's equality rule: a hit is right when it carries the model's label."""
    return cached.label == fresh.label


class Verifier:
    def __init__(self, state_path: Path, seed: int | None = None) -> None:
        self.state_path = state_path
        self.rules = Rules(seed)
        self.log: EvidenceLog | None = None
        self.pending: OrderedDict[str, Pending] = OrderedDict()
        self.counts = dict.fromkeys(("candidates", "verified", "disagreements", "after_reply"), 0)
        self._policies: dict[str, tuple[tuple[str, str, str, str], VerifyPolicy]] = {}
        # SQLite writes off the event loop, in order, apart from Milvus's threads.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evidence")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.log = await loop.run_in_executor(self._writer, EvidenceLog, self.state_path)
        replayed = await loop.run_in_executor(self._writer, self.log.replay, self.rules)
        if self.log.unreadable is not None:
            log.warning(
                "verified-hit evidence unreadable, set aside; learning again",
                extra={
                    "path": str(self.state_path),
                    "set_aside": str(self.log.set_aside),
                    "error": self.log.unreadable,
                },
            )
        elif self.log.set_aside is not None:
            log.warning(
                "verified-hit evidence of another schema set aside; learning again",
                extra={"path": str(self.state_path), "set_aside": str(self.log.set_aside)},
            )
        log.info(
            "verified-hit evidence replayed",
            extra={"path": str(self.state_path), "observations": replayed},
        )

    async def stop(self) -> None:
        if self.log is not None:
            evidence, self.log = self.log, None
            await asyncio.get_running_loop().run_in_executor(self._writer, evidence.close)
        self._writer.shutdown(wait=True)

    def serve(
        self,
        scope: tuple[str, str, str, str],
        eligible: list[tuple[Entry, float, str]],
        policy: VerifyPolicy,
    ) -> tuple[tuple[Entry, float] | None, str]:
        """The nearest candidate (entry, similarity, answer; runner-ups after it) if the
        scope's rule serves it, and the verify_id when the rule wants the model's answer
        ('' if not). The runner-ups make its stratum."""
        if not eligible:
            return None, ""
        entry, similarity, label = eligible[0]
        agreeing = sum(other == label for _, _, other in eligible[1:])
        cached = common_pb2.Prediction.FromString(entry.response)
        decision, verify_id, threshold = self.decide(
            scope, cached, similarity, policy, stratum(agreeing, len(eligible) - 1 - agreeing)
        )
        trace.get_current_span().set_attributes(
            {
                schema.CACHE_VERIFY_DECISION: decision.value,
                schema.CACHE_VERIFY_THRESHOLD: threshold,
            }
        )
        served = decision in (Decision.SERVE, Decision.SERVE_AND_VERIFY)
        return ((entry, similarity) if served else None), verify_id

    def decide(
        self,
        scope: tuple[str, str, str, str],
        cached: common_pb2.Prediction,
        similarity: float,
        policy: VerifyPolicy,
        stratum: str,
    ) -> tuple[Decision, str, float]:
        """The rule's decision for a candidate, its verify_id ('' if none) and threshold."""
        key = scope_key(scope)
        self._policies[key] = (scope, policy)
        decision, weight = self.rules.decide(key, cached.label, similarity, policy, stratum)
        threshold = self.rules.threshold_for(key, cached.label, policy, stratum)
        self.counts["candidates"] += 1
        self.counts["after_reply"] += decision is Decision.SERVE_AND_VERIFY
        metrics.CACHE_VERIFY_CANDIDATES.labels(scope[1], decision.value).inc()
        metrics.CACHE_VERIFY_THRESHOLD.labels(*scope[:3]).set(
            self.rules.evidence(key).lowest_threshold(policy)
        )
        if decision not in (Decision.SERVE_AND_VERIFY, Decision.VERIFY_FIRST):
            return decision, "", threshold
        verify_id = secrets.token_hex(16)
        self._expire(time.monotonic())
        self.pending[verify_id] = Pending(
            scope, cached.label, stratum, similarity, weight, policy, time.monotonic()
        )
        return decision, verify_id, threshold

    def _expire(self, now: float) -> None:
        while self.pending:
            oldest = next(iter(self.pending.values()))
            if len(self.pending) < PENDING_MAX and now - oldest.created < PENDING_TTL_S:
                return
            self.pending.popitem(last=False)

    async def report(self, verify_id: str, fresh: common_pb2.Prediction) -> bool:
        """Compare the model's answer with the candidate's; KeyError for an unknown id."""
        pending = self.pending.pop(verify_id)
        agreed = same_answer(common_pb2.Prediction(label=pending.region), fresh)
        key = scope_key(pending.scope)
        judged = self.rules.observe(
            key,
            pending.region,
            Observation(pending.similarity, agreed, pending.weight, stratum=pending.stratum),
            pending.policy,
        )
        self.counts["verified"] += 1
        self.counts["disagreements"] += not agreed
        metrics.CACHE_VERIFIED.labels(pending.scope[1], "agreed" if agreed else "disagreed").inc()
        if self.log is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._writer, self.log.append, [(key, pending.region, judged)]
            )
        return agreed

    def rules_for_stats(self) -> list[cache_pb2.VerifyRule]:
        out = []
        for key, evidence in self.rules.scopes.items():
            if key not in self._policies:
                continue  # replayed but not looked up since the start: no policy known
            scope, policy = self._policies[key]
            rule = evidence.rule(policy)
            out.append(
                cache_pb2.VerifyRule(
                    scope=common_pb2.Scope(
                        tenant=scope[0],
                        model=scope[1],
                        model_version=scope[2],
                        parameters=json.loads(scope[3]),
                    ),
                    threshold=rule.threshold,
                    learned=rule.learned,
                    observations=rule.observations,
                    disagreements=rule.disagreements,
                    held_back=rule.held_back,
                    strata=rule.strata,
                )
            )
        return out
