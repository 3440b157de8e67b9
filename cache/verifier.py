"""The cache service's side of verified hits: decisions, pending comparisons, evidence on disk.

`cache/verify.py` holds the rule; this module applies it to lookups. A lookup whose request
carries the model's `verify_target` has its best semantic candidate (past the unseen-parts
check and the runner-up agreement rule) decided by the scope's rule. SERVE_AND_VERIFY and
VERIFY_FIRST get a `verify_id`: the caller reports the model's answer for that id with
ReportVerification (to any replica: the id carries the comparison, cache/verify_ids.py), the
two answers are compared (the same label: the classifier's equality rule) and the result
becomes evidence, appended to the evidence store (cache/evidence.py) that every replica over
one Milvus server shares and follows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from opentelemetry import trace

from hopline.cache import milvus_log
from hopline.cache.evidence import EvidenceStore, Noted
from hopline.cache.store import CacheStoreError, Entry
from hopline.cache.verify import (
    Decision,
    Observation,
    Rules,
    VerifyPolicy,
    scope_key,
    stratum,
)
from hopline.cache.verify_ids import (
    KEYS_READ_S,
    PENDING_TTL_S,
    Pending,
    UnknownKey,
    VerifyIds,
    new_nonce,
)
from hopline.observability import metrics, schema
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.cache.verify")
T = TypeVar("T")

LEARN_SPAN = 0.3  # candidates this far below the static threshold are still learned from
KEYS_READ_EVERY_S = 1.0  # the store's signing keys read again at most this often
UNSENT_MAX = 10_000  # observations held for the store while it cannot be written


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
    def __init__(self, seed: int | None = None) -> None:
        self.where = ""  # the store, for logs
        self.rules = Rules(seed)
        self.store: EvidenceStore | None = None
        self.ids = VerifyIds([])
        self.counts = dict.fromkeys(("candidates", "verified", "disagreements", "after_reply"), 0)
        self._policies: dict[str, tuple[tuple[str, str, str, str], VerifyPolicy]] = {}
        self._forget: list[str] = []  # scopes the rules forgot, their rows still in the store
        # Each (model, version)'s scopes' thresholds, for its gauge: the lowest of them. By
        # tenant, the gauge named every tenant to anyone who can read /metrics, which takes
        # no key (a security probe).
        self._thresholds: dict[tuple[str, str], dict[str, float]] = {}
        self._unsent: deque[Noted] = deque()  # not written yet: the store was unreachable
        self._store_failing = False
        self._keys_read = 0.0  # monotonic time the keys were last read again
        # Store calls off the event loop, in order, apart from Milvus's threads.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evidence")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def start(self, open_store: Callable[[], EvidenceStore], where: str) -> None:
        """Opens the store and replays it into the rules (before the cache is SERVING)."""
        self.where = where
        self.store = store = await self._run(open_store)
        replayed = await self._run(store.replay)
        self._take(replayed)
        self.ids.learn(await self._run(store.keys))
        if store.unreadable is not None:
            log.warning(
                "verified-hit evidence unreadable, set aside; learning again",
                extra={
                    "path": self.where,
                    "set_aside": str(store.set_aside),
                    "error": store.unreadable,
                },
            )
        elif store.set_aside is not None:
            log.warning(
                "verified-hit evidence of another schema set aside; learning again",
                extra={"path": self.where, "set_aside": str(store.set_aside)},
            )
        log.info(
            "verified-hit evidence replayed",
            extra={"path": self.where, "observations": len(replayed)},
        )

    def _take(self, rows: list[Noted]) -> None:
        """Observations made elsewhere (before a restart, or by a peer) into the rules, as
        they were judged; their verify ids count as reported."""
        now = time.time()
        for nonce, scope, region, obs in rows:
            self.rules.evidence(scope).add(region, obs)
            if nonce and now - obs.at <= PENDING_TTL_S:
                self.ids.taken(nonce, obs.at, now)
        self._drop_forgotten()

    def _drop_forgotten(self) -> None:
        """What is kept of the scopes the rules forgot: their policy, their threshold's
        series (one per tenant name a caller chose, for good, before), and (sent with the next
        write) their rows in a store no other process reads."""
        if not self.rules.forgotten:
            return
        for key in self.rules.forgotten:
            known = self._policies.pop(key, None)
            if known is not None:
                self._threshold(known[0], key, None)
        self._forget.extend(self.rules.forgotten)
        self.rules.forgotten.clear()

    def _threshold(self, scope: tuple[str, str, str, str], key: str, value: float | None) -> None:
        """A scope's threshold into its (model, version)'s gauge, the lowest of its scopes';
        None: the scope is forgotten (the gauge's series goes with the last one)."""
        labels = (scope[1], scope[2])
        held = self._thresholds.setdefault(labels, {})
        if value is not None:
            held[key] = value
        else:
            held.pop(key, None)
        if held:
            metrics.CACHE_VERIFY_THRESHOLD.labels(*labels).set(min(held.values()))
            return
        del self._thresholds[labels]
        with contextlib.suppress(KeyError):  # never set
            metrics.CACHE_VERIFY_THRESHOLD.remove(*labels)

    async def follow(self, poll_s: float) -> None:
        """The peers' observations into the rules every `poll_s`, for good (with what this
        replica could not write before); every milvus_log.TRIM_EVERY_S the rows past every
        window leave the store."""

        async def poll() -> None:
            if (store := self.store) is None:
                return  # stopped
            if self._unsent:
                await self._keep([])
            rows = await self._run(store.poll)
            self._take(rows)
            metrics.CACHE_VERIFY_EVIDENCE.labels("read_from_peers").inc(len(rows))

        async def trim() -> None:
            if (store := self.store) is not None:
                await self._run(store.trim, self.rules.cutoffs())

        await milvus_log.follow("the peers' evidence", poll, trim, poll_s)

    async def keep_keys(self) -> None:
        """The store's signing keys read again every KEYS_READ_S, for good: the read makes a
        new key when one is due and deletes the retired ones (cache/verify_ids.py). While the
        store cannot be read the keys in memory go on signing. Every milvus_log.TRIM_EVERY_S
        the store is tidied (`_tidy`): a SQLite file is followed by no peers' loop."""

        async def read() -> None:
            if (store := self.store) is not None:
                self.ids.learn(await self._run(store.keys))

        await milvus_log.follow("the verify-id keys", read, self._tidy, KEYS_READ_S)

    async def stop(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            await self._run(store.close)
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
        decision, weight = self.rules.decide(key, cached.label, similarity, policy, stratum)
        self._policies[key] = (scope, policy)
        self._drop_forgotten()
        threshold = self.rules.threshold_for(key, cached.label, policy, stratum)
        self.counts["candidates"] += 1
        self.counts["after_reply"] += decision is Decision.SERVE_AND_VERIFY
        metrics.CACHE_VERIFY_CANDIDATES.labels(scope[1], decision.value).inc()
        self._threshold(scope, key, self.rules.evidence(key).lowest_threshold(policy))
        if decision not in (Decision.SERVE_AND_VERIFY, Decision.VERIFY_FIRST):
            return decision, "", threshold
        pending = Pending(
            new_nonce(), scope, cached.label, stratum, similarity, weight, policy, time.time()
        )
        return decision, self.ids.issue(pending), threshold

    async def report(self, verify_id: str, fresh: common_pb2.Prediction) -> bool:
        """Compare the model's answer with the candidate's. Raises UnknownVerifyId (taken,
        expired, a key no store here knows) and BadVerifyId (not an id a cache issued)."""
        try:
            pending = self.ids.open(verify_id, time.time())
        except UnknownKey:
            # A peer started since this replica read the keys and signed with its own. At
            # most once a second: ids naming made-up keys must not become Milvus queries.
            if self.store is None or time.monotonic() - self._keys_read < KEYS_READ_EVERY_S:
                raise
            self._keys_read = time.monotonic()
            self.ids.learn(await self._run(self.store.keys))  # CacheStoreError: UNAVAILABLE
            pending = self.ids.open(verify_id, time.time())
        agreed = same_answer(common_pb2.Prediction(label=pending.region), fresh)
        key = scope_key(pending.scope)
        observed = Observation(
            pending.similarity, agreed, pending.weight, stratum=pending.stratum, at=time.time()
        )
        judged = self.rules.observe(key, pending.region, observed, pending.policy)
        self._drop_forgotten()
        self.counts["verified"] += 1
        self.counts["disagreements"] += not agreed
        metrics.CACHE_VERIFIED.labels(pending.scope[1], "agreed" if agreed else "disagreed").inc()
        await self._keep([Noted(pending.nonce, key, pending.region, judged)])
        return agreed

    async def _keep(self, rows: list[Noted]) -> None:
        """Write `rows` to the store, after any it could not take before. While it cannot
        (Milvus unreachable) they are learnt here only and held, up to UNSENT_MAX, and sent
        once it can: the peers and the next start see them then."""
        if self.store is None:
            return
        now = time.time()
        # Restamped: a peer's poll reads the last seconds, and would pass over their time.
        held = [row._replace(obs=dataclasses.replace(row.obs, at=now)) for row in self._unsent]
        self._unsent.clear()
        batch = held + rows
        try:
            await self._run(self.store.append, batch)
        except CacheStoreError as exc:
            kept = batch[-UNSENT_MAX:]
            self._unsent.extend(kept)
            metrics.CACHE_VERIFY_EVIDENCE.labels("not_kept").inc(len(batch) - len(kept))
            if not self._store_failing:  # once per outage
                log.warning(
                    "keeping verified-hit evidence failed; holding it for the store",
                    extra={"error": str(exc), "held": len(self._unsent)},
                )
            self._store_failing = True
            return
        if self._store_failing:
            log.info("keeping verified-hit evidence again", extra={"sent": len(batch)})
        self._store_failing = False

    async def _tidy(self) -> None:
        """The store's rows of forgotten scopes and those past their windows, dropped."""
        if (store := self.store) is None:
            return
        forget, self._forget = self._forget, []
        try:
            if forget:
                await self._run(store.forget, forget)
            await self._run(store.trim, self.rules.cutoffs())
        except sqlite3.Error as exc:  # the next tidy tries again; the keys loop goes on
            self._forget.extend(forget)
            log.warning("tidying verified-hit evidence failed", extra={"error": str(exc)})

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
