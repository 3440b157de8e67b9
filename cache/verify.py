"""Verified semantic hits: how far each answer can be trusted, learned online from the model.

A semantic candidate is an entry the search found for a query. Where the model's policy sets
a target wrong-hit rate (`verify_target`, with `verify_confidence`), every candidate at or
above `floor` gets a Decision:

- SERVE_AND_VERIFY / SERVE: the cached answer is served at once; with a probability that is
  high while little is known and falls as evidence grows, the model also answers the query
  after the reply and the two answers are compared (an extra inference, off the reply's path).
- VERIFY_FIRST: the rule does not trust this similarity yet, so the model answers, as on a
  miss; the comparison costs nothing extra and is evidence for the rule.

Evidence is kept twice. Per **stratum**: what the other search results say about the
candidate, `A+D` for A runner-ups carrying its answer and D another (`stratum`); a candidate
whose neighbourhood agrees is far safer at a given similarity than one between answers, so
each stratum learns its own threshold. Per **region**: a scope's entries that carry the same
answer (the prediction's label). Per entry it would be too thin to use: on CLINC150 15,000
cached texts see about one lookup each, and a wrong hit is a property of the answer (two
intents the encoder puts close together), not of one text. Each observation is
(similarity, agreed, weight), the weight 1/p for a served hit that was verified with
probability p, so the served hits count as often as they were served.

The rule (`Rules.decide`) has two parts:

1. **Stratum threshold**, recalibrated from the stratum's pooled evidence with the rule
   `hopline cache calibrate` uses: the lowest observed similarity whose hits at or above it
   number at least min_hits (2 / target, effective) and whose one-sided Wilson upper bound on
   the disagreement rate at `confidence` is at most the target, unless a higher threshold
   with min_hits hits measures over the target. Until the evidence suffices, the model's
   static `threshold` (calibrated offline) is the rule. Each stratum under the target keeps
   the whole under it.
2. **Held-back regions**: a region (or, before a stratum has evidence, the stratum) whose
   own observations at or above some similarity show, with the stated confidence, a
   disagreement rate above the target (the Wilson *lower* bound exceeds it) is not served at
   or below that similarity. One disagreement with nothing agreeing above it holds a region
   back; one among thirty agreements does not. A scope seeded with disagreeing answers
   therefore stops being served at once, and starts again only when agreements outweigh
   them. The pools count only observations the region rule would have served when they were
   made, so the region rule cannot flatter the pooled rate after the fact.

Decisions survive a restart: observations are appended to an evidence store (cache/evidence.py:
a SQLite file beside a milvus-lite file, or a collection of the Milvus server the replicas
share) and replayed at start-up; the rules are recomputed from them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from statistics import NormalDist

REGION_WINDOW = 512  # observations kept per region: the rule follows recent traffic
SCOPE_WINDOW = 6_000  # pooled observations per scope: recent enough to follow the traffic
MAX_SCOPES = 4096  # scopes whose evidence is kept, the least recently used forgotten (Rules)
RECOMPUTE_EVERY = 32  # agreeing observations between recomputations of a scope's threshold
NEVER = 1.0 + 1e-6  # a threshold no similarity reaches
ABOVE = 1e-6  # a held-back region serves only above its highest contradicted similarity


class Decision(enum.Enum):
    SERVE = "serve"  # trusted, not checked this time
    SERVE_AND_VERIFY = "serve_and_verify"  # served now, compared with the model after reply
    VERIFY_FIRST = "verify_first"  # not trusted yet: the model answers, the comparison is kept
    MISS = "miss"  # below the floor: a plain miss, nothing learned


@dataclasses.dataclass(frozen=True)
class VerifyPolicy:
    """A model's verification settings, as the gateway sends them with each lookup."""

    target: float  # the wrong-hit rate (share of served semantic hits) to stay under
    confidence: float  # one-sided confidence of the bounds
    prior_threshold: float  # the model's static threshold: the rule before any evidence
    floor: float  # candidates below this similarity are plain misses
    min_rate: float = 0.05  # verification rate a well-known region keeps (the live check)
    explore: float = 4.0  # verify with probability explore / (1 + observations above)

    @property
    def min_hits(self) -> int:
        """Two wrong hits' worth at the target: fewer cannot tell the target from twice it."""
        return math.ceil(2 / self.target)


@dataclasses.dataclass(frozen=True)
class Observation:
    similarity: float
    agreed: bool
    weight: float  # 1 / the probability this candidate was verified with
    # Whether the region's rule, as it stood before this observation, would have served it:
    # the scope's threshold is calibrated on these only, each judged before its outcome was
    # known, so the region rule's own fit cannot flatter the pooled rate.
    region_ok: bool = True
    stratum: str = ""  # see `stratum`
    at: float = 0.0  # wall clock when it was made: the shared store trims by it


@dataclasses.dataclass(frozen=True)
class Rule:
    """The acceptance rule of a scope right now, for GetStats, metrics and span attributes."""

    threshold: float  # semantic hits at or above this similarity are served
    learned: bool  # from live evidence (else the static prior, possibly raised)
    observations: int  # pooled, in the window
    disagreements: int
    held_back: int  # regions whose own evidence raised their threshold above the scope's
    strata: dict[str, float] = dataclasses.field(default_factory=dict)  # threshold each


def wilson(bad: float, n: float, confidence: float, *, upper: bool) -> float:
    """One-sided Wilson bound on a rate of bad / n at `confidence` (n may be effective)."""
    if n <= 0:
        return 1.0 if upper else 0.0
    z = NormalDist().inv_cdf(confidence)
    p = min(1.0, max(0.0, bad / n))
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    sign = 1.0 if upper else -1.0
    return (centre + sign * spread) / (1 + z * z / n)


def _prefixes(obs: Iterable[Observation]) -> list[tuple[float, float, float, float]]:
    """(similarity, weight, squared weight, disagreeing weight) at or above each observed
    similarity, highest first; equal similarities are admitted together."""
    ranked = sorted(obs, key=lambda o: -o.similarity)
    out: list[tuple[float, float, float, float]] = []
    w = w2 = bad = 0.0
    for i, o in enumerate(ranked):
        w += o.weight
        w2 += o.weight * o.weight
        bad += 0.0 if o.agreed else o.weight
        if i + 1 == len(ranked) or ranked[i + 1].similarity != o.similarity:
            out.append((o.similarity, w, w2, bad))
    return out


def contradicted_above(obs: Iterable[Observation], policy: VerifyPolicy) -> float:
    """The highest similarity at which the observations at or above it show, with the
    policy's confidence, a disagreement rate over the target; 0 when none does."""
    for s, w, w2, bad in _prefixes(obs):
        n = w * w / w2
        if wilson(bad / w * n, n, policy.confidence, upper=False) > policy.target:
            return s
    return 0.0


def learned_threshold(obs: Sequence[Observation], policy: VerifyPolicy) -> float | None:
    """The calibrate rule on live evidence (module docstring, part 1); None: too little."""
    best: float | None = None
    for s, w, w2, bad in _prefixes(obs):
        if s < policy.floor:
            break
        n = w * w / w2  # effective count: weighted observations are noisier than plain ones
        if n < policy.min_hits:
            continue
        rate = bad / w
        if rate > policy.target:
            break  # a veto: no lower threshold holds these hits and stays under the target
        if wilson(rate * n, n, policy.confidence, upper=True) <= policy.target:
            best = s
    return best


class ScopeEvidence:
    """What one scope's verified candidates said, and the rules that follow from it.

    Pooled evidence is kept per stratum (`stratum`): candidates whose runner-ups agree
    with them are far safer at a given similarity than those whose runner-ups carry other
    answers, so each stratum learns its own threshold, each under the target.
    """

    def __init__(self) -> None:
        self.pooled: dict[str, deque[tuple[str, Observation]]] = {}
        self.regions: dict[str, deque[Observation]] = {}
        self._rule: dict[str, tuple[float, bool]] = {}  # per stratum, recomputed lazily
        self._unseen: dict[str, int] = {}  # observations since the stratum's rule
        self._region_floor: dict[str, float] = {}

    def add(self, region: str, obs: Observation) -> None:
        """`obs.region_ok` must say what the region's rule said before `obs` (see `judge`)."""
        pool = self.pooled.setdefault(obs.stratum, deque(maxlen=SCOPE_WINDOW))
        pool.append((region, obs))
        self.regions.setdefault(region, deque(maxlen=REGION_WINDOW)).append(obs)
        self._region_floor.pop(region, None)
        unseen = self._unseen.get(obs.stratum, 0) + 1
        self._unseen[obs.stratum] = unseen
        # Sorting the pool per observation would cost more than the lookups: recompute
        # every RECOMPUTE_EVERY, and at once on a disagreement.
        if not obs.agreed or unseen >= RECOMPUTE_EVERY:
            self._rule.pop(obs.stratum, None)

    def scope_threshold(self, policy: VerifyPolicy, stratum: str = "") -> tuple[float, bool]:
        """The stratum's threshold, and whether it was learned (else the prior, or raised)."""
        if stratum not in self._rule:
            self._unseen[stratum] = 0
            pool = self.pooled.get(stratum, ())
            learned = learned_threshold([o for _, o in pool if o.region_ok], policy)
            if learned is not None:
                self._rule[stratum] = (learned, True)
            else:
                held = contradicted_above((o for _, o in pool), policy)
                raised = held + ABOVE if held else 0.0
                self._rule[stratum] = (max(policy.prior_threshold, raised), False)
        return self._rule[stratum]

    def region_threshold(self, region: str, policy: VerifyPolicy, stratum: str = "") -> float:
        """The stratum's threshold, raised above where the region's own evidence objects."""
        return max(self.scope_threshold(policy, stratum)[0], self._floor(region, policy))

    def judge(self, region: str, obs: Observation, policy: VerifyPolicy) -> Observation:
        """`obs` with region_ok set by the region's rule as it stands now."""
        return dataclasses.replace(obs, region_ok=obs.similarity > self._floor(region, policy))

    def _floor(self, region: str, policy: VerifyPolicy) -> float:
        if region not in self._region_floor:
            held = contradicted_above(self.regions.get(region, ()), policy)
            self._region_floor[region] = held + ABOVE if held else 0.0
        return self._region_floor[region]

    def seen_above(self, region: str, threshold: float) -> int:
        return sum(o.similarity >= threshold for o in self.regions.get(region, ()))

    def lowest_threshold(self, policy: VerifyPolicy) -> float:
        """The lowest similarity any stratum serves at now (cheap: each is cached)."""
        strata = [self.scope_threshold(policy, name)[0] for name in self.pooled]
        return min(strata, default=policy.prior_threshold)

    def rule(self, policy: VerifyPolicy) -> Rule:
        strata = {name: self.scope_threshold(policy, name) for name in sorted(self.pooled)}
        lowest = min((t for t, _ in strata.values()), default=policy.prior_threshold)
        pooled = [o for pool in self.pooled.values() for _, o in pool]
        return Rule(
            threshold=lowest,
            learned=any(learned for _, learned in strata.values()),
            observations=len(pooled),
            disagreements=sum(not o.agreed for o in pooled),
            held_back=sum(self._floor(r, policy) > lowest for r in self.regions),
            strata={name: t for name, (t, _) in strata.items()},
        )


def stratum(agreeing: int, disagreeing: int) -> str:
    """A candidate's stratum: how many of the runner-ups the search returned carry its
    answer and how many another ("3+0": all three agree)."""
    return f"{agreeing}+{disagreeing}"


class Rules:
    """Every scope's evidence; decides candidates and takes their comparisons.

    At most `max_scopes` scopes are kept, the least recently used forgotten past it (listed
    in `forgotten` for the caller to drop elsewhere too): without API keys a caller names
    its tenant, and each tenant's scope was kept for good (a soak probe: one
    `hopline_cache_verify_threshold` series and scope per tenant name sent). A scope used
    again starts over from its prior, which verifies more, never less."""

    def __init__(self, seed: int | None = None, max_scopes: int = MAX_SCOPES) -> None:
        self.scopes: collections.OrderedDict[str, ScopeEvidence] = collections.OrderedDict()
        self.max_scopes = max_scopes
        self.forgotten: list[str] = []
        self._rng = random.Random(seed)

    def evidence(self, scope: str) -> ScopeEvidence:
        found = self.scopes.get(scope)
        if found is not None:
            self.scopes.move_to_end(scope)
            return found
        made = self.scopes[scope] = ScopeEvidence()
        while len(self.scopes) > self.max_scopes:
            oldest, _ = self.scopes.popitem(last=False)
            self.forgotten.append(oldest)
        return made

    def cutoffs(self) -> dict[tuple[str, str], float]:
        """Per full (scope, stratum) pool, its oldest observation's time: what was made
        before has left the window, and the shared store may drop it."""
        return {
            (scope, name): min(o.at for _, o in pool)
            for scope, evidence in self.scopes.items()
            for name, pool in evidence.pooled.items()
            if len(pool) == SCOPE_WINDOW
        }

    def threshold_for(
        self, scope: str, region: str, policy: VerifyPolicy, stratum: str = ""
    ) -> float:
        return self.evidence(scope).region_threshold(region, policy, stratum)

    def decide(
        self,
        scope: str,
        region: str,
        similarity: float,
        policy: VerifyPolicy,
        stratum: str = "",
    ) -> tuple[Decision, float]:
        """What to do with a candidate, and the weight its comparison will carry."""
        if similarity < policy.floor:
            return Decision.MISS, 0.0
        evidence = self.evidence(scope)
        threshold = evidence.region_threshold(region, policy, stratum)
        if similarity < threshold:
            return Decision.VERIFY_FIRST, 1.0
        p = self.verify_probability(evidence, region, threshold, policy, stratum)
        if self._rng.random() < p:
            return Decision.SERVE_AND_VERIFY, 1.0 / p
        return Decision.SERVE, 0.0

    @staticmethod
    def verify_probability(
        evidence: ScopeEvidence,
        region: str,
        threshold: float,
        policy: VerifyPolicy,
        stratum: str = "",
    ) -> float:
        """1 while the stratum's rule rests on the prior or the region has seen nothing
        above its threshold; then explore / (1 + what it has seen there), at least
        min_rate."""
        if not evidence.scope_threshold(policy, stratum)[1]:
            return 1.0
        seen = evidence.seen_above(region, threshold)
        return max(policy.min_rate, min(1.0, policy.explore / (1 + seen)))

    def observe(
        self, scope: str, region: str, obs: Observation, policy: VerifyPolicy
    ) -> Observation:
        """Judge `obs` by the region's rule before it, then keep it; returns it judged."""
        evidence = self.evidence(scope)
        judged = evidence.judge(region, obs, policy)
        evidence.add(region, judged)
        return judged


def scope_key(scope: tuple[str, str, str, str]) -> str:
    """A scope as one string, for the evidence table and the rules' dict."""
    return json.dumps(list(scope), separators=(",", ":"), ensure_ascii=False)
