"""The verified-hit rule (cache/verify.py) on evidence built by hand: what it serves, what it
holds back, how often it checks, and that its evidence log replays into the same rule."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hopline.cache.verify import (
    Decision,
    EvidenceLog,
    Observation,
    Rules,
    VerifyPolicy,
    contradicted_above,
    learned_threshold,
    stratum,
    wilson,
)

POLICY = VerifyPolicy(target=0.01, confidence=0.9, prior_threshold=0.85, floor=0.55)
SCOPE = '["t","m","1","{}"]'


def test_wilson_bounds_bracket_the_rate() -> None:
    assert wilson(1, 100, 0.9, upper=False) < 0.01 < wilson(1, 100, 0.9, upper=True)
    assert wilson(0, 0, 0.9, upper=True) == 1.0
    # One disagreement with nothing else says, with 90% confidence, the rate is over 1%.
    assert wilson(1, 1, 0.9, upper=False) > 0.01


def test_without_evidence_the_static_threshold_rules_and_every_served_hit_is_checked() -> None:
    rules = Rules(seed=1)
    assert rules.decide(SCOPE, "a", 0.90, POLICY)[0] is Decision.SERVE_AND_VERIFY
    assert rules.decide(SCOPE, "a", 0.80, POLICY) == (Decision.VERIFY_FIRST, 1.0)
    assert rules.decide(SCOPE, "a", 0.50, POLICY)[0] is Decision.MISS  # below the floor
    assert rules.threshold_for(SCOPE, "a", POLICY) == POLICY.prior_threshold


def test_enough_agreeing_evidence_lowers_the_threshold_and_the_check_rate() -> None:
    rules = Rules(seed=2)
    rng = random.Random(0)
    for _ in range(600):  # 3x min_hits, all agreeing, spread over 0.6..1
        rules.observe(SCOPE, "a", Observation(rng.uniform(0.6, 1.0), True, 1.0), POLICY)
    threshold, learned = rules.evidence(SCOPE).scope_threshold(POLICY)
    assert learned
    assert threshold < POLICY.prior_threshold
    assert rules.decide(SCOPE, "a", 0.75, POLICY)[0] in (Decision.SERVE, Decision.SERVE_AND_VERIFY)
    p = Rules.verify_probability(rules.evidence(SCOPE), "a", threshold, POLICY)
    assert POLICY.min_rate <= p < 0.05 + 1e-9
    # An answer the scope has never seen above the threshold is checked every time.
    assert Rules.verify_probability(rules.evidence(SCOPE), "b", threshold, POLICY) == 1.0


def test_too_many_disagreements_keep_the_threshold_where_it_was() -> None:
    obs = [Observation(0.6 + i / 1000, i % 20 != 0, 1.0) for i in range(400)]  # 5% wrong
    assert learned_threshold(obs, POLICY) is None


def test_disagreements_hold_an_answer_back_and_agreements_release_it() -> None:
    rules = Rules(seed=3)
    rules.observe(SCOPE, "a", Observation(0.95, False, 1.0), POLICY)
    assert rules.threshold_for(SCOPE, "a", POLICY) > 0.95
    assert rules.decide(SCOPE, "a", 0.93, POLICY)[0] is Decision.VERIFY_FIRST
    # Another answer in the same scope: held back too, since the scope as a whole has no
    # evidence beyond that one disagreement at the prior.
    assert rules.decide(SCOPE, "b", 0.99, POLICY)[0] is Decision.SERVE_AND_VERIFY
    for i in range(40):
        rules.observe(SCOPE, "a", Observation(0.951 + i / 1000, True, 1.0), POLICY)
    assert contradicted_above(rules.evidence(SCOPE).regions["a"], POLICY) == 0.0
    assert rules.threshold_for(SCOPE, "a", POLICY) == POLICY.prior_threshold


def test_observations_are_judged_by_the_region_rule_before_them() -> None:
    rules = Rules(seed=4)
    first = rules.observe(SCOPE, "a", Observation(0.9, False, 1.0), POLICY)
    second = rules.observe(SCOPE, "a", Observation(0.9, True, 1.0), POLICY)
    assert first.region_ok
    assert not second.region_ok


def test_the_evidence_log_replays_into_the_same_rule(tmp_path: Path) -> None:
    rules = Rules(seed=5)
    log = EvidenceLog(tmp_path / "evidence.sqlite")
    rows = []
    for i in range(30):
        judged = rules.observe(SCOPE, "a", Observation(0.9 + i / 1000, i != 7, 2.0), POLICY)
        rows.append((SCOPE, "a", judged))
    log.append(rows)
    log.close()
    replayed = Rules(seed=5)
    reopened = EvidenceLog(tmp_path / "evidence.sqlite")
    assert reopened.replay(replayed) == 30
    reopened.close()
    assert replayed.threshold_for(SCOPE, "a", POLICY) == rules.threshold_for(SCOPE, "a", POLICY)
    assert list(replayed.evidence(SCOPE).regions["a"]) == list(rules.evidence(SCOPE).regions["a"])
    assert replayed.threshold_for(SCOPE, "a", POLICY) > 0.907  # the disagreement at 0.907


@pytest.mark.parametrize("target", [0.01, 0.05])
def test_min_hits_is_two_wrong_hits_worth(target: float) -> None:
    policy = VerifyPolicy(target, 0.9, 0.85, 0.55)
    assert policy.min_hits == round(2 / target)


def test_each_stratum_learns_its_own_threshold() -> None:
    rules = Rules(seed=6)
    rng = random.Random(1)
    agreeing, split = stratum(3, 0), stratum(1, 2)
    for _ in range(600):
        s = rng.uniform(0.6, 1.0)
        rules.observe(SCOPE, "a", Observation(s, True, 1.0, stratum=agreeing), POLICY)
        # Where the runner-ups carry other answers, a quarter of the candidates are wrong.
        wrong = rng.random() < 0.25
        rules.observe(SCOPE, "b", Observation(s, not wrong, 1.0, stratum=split), POLICY)
    evidence = rules.evidence(SCOPE)
    low, learned = evidence.scope_threshold(POLICY, agreeing)
    assert learned
    assert low < POLICY.prior_threshold
    high, _ = evidence.scope_threshold(POLICY, split)
    assert high > POLICY.prior_threshold
    assert rules.decide(SCOPE, "c", 0.7, POLICY, agreeing)[0] is not Decision.VERIFY_FIRST
    assert rules.decide(SCOPE, "c", 0.7, POLICY, split)[0] is Decision.VERIFY_FIRST
    assert evidence.rule(POLICY).strata == {agreeing: low, split: high}
