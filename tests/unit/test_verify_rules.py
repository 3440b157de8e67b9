"""The verified-hit rule (cache/verify.py) on evidence built by hand: what it serves, what it
holds back, how often it checks, and that its evidence log (cache/evidence.py) replays into
the same rule."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from hopline.cache.evidence import SCHEMA_VERSION, EvidenceLog, Noted
from hopline.cache.store import CacheSettingError
from hopline.cache.verify import (
    Decision,
    Observation,
    Rules,
    VerifyPolicy,
    contradicted_above,
    learned_threshold,
    stratum,
    wilson,
)


def into(rules: Rules, rows: list[Noted]) -> int:
    """The replayed rows into `rules`, as the verifier takes them; how many."""
    for _, scope, region, obs in rows:
        rules.evidence(scope).add(region, obs)
    return len(rows)


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
        made = Observation(0.9 + i / 1000, i != 7, 2.0, at=1000.0 + i)
        judged = rules.observe(SCOPE, "a", made, POLICY)
        rows.append(Noted("", SCOPE, "a", judged))
    log.append(rows)
    log.close()
    replayed = Rules(seed=5)
    reopened = EvidenceLog(tmp_path / "evidence.sqlite")
    assert into(replayed, reopened.replay()) == 30
    reopened.close()
    assert replayed.threshold_for(SCOPE, "a", POLICY) == rules.threshold_for(SCOPE, "a", POLICY)
    assert list(replayed.evidence(SCOPE).regions["a"]) == list(rules.evidence(SCOPE).regions["a"])
    assert replayed.threshold_for(SCOPE, "a", POLICY) > 0.907  # the disagreement at 0.907


def test_an_evidence_file_of_another_schema_is_set_aside_not_misread(tmp_path: Path) -> None:
    """A file from an older schema (no region_ok, no stratum: what crashed a cache's start-up
    once) is moved aside whole and a new log begun; nothing of it is read or deleted."""
    path = tmp_path / "evidence.sqlite"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE observations (scope TEXT NOT NULL, region TEXT NOT NULL,"
        " similarity REAL NOT NULL, agreed INTEGER NOT NULL, weight REAL NOT NULL,"
        " at REAL NOT NULL)"
    )
    old.execute("INSERT INTO observations VALUES ('s', 'a', 0.9, 1, 1.0, 0)")
    old.commit()
    old.close()
    log = EvidenceLog(path)
    assert log.set_aside == tmp_path / "evidence.sqlite.v1"
    assert into(Rules(seed=1), log.replay()) == 0
    log.append([Noted("", SCOPE, "a", Observation(0.9, True, 1.0))])
    log.close()
    kept = sqlite3.connect(tmp_path / "evidence.sqlite.v1")
    assert kept.execute("SELECT COUNT(*) FROM observations").fetchone() == (1,)
    kept.close()
    reopened = EvidenceLog(path)  # now of this schema: kept, versioned
    assert reopened.set_aside is None
    assert into(Rules(seed=1), reopened.replay()) == 1
    reopened.close()
    versioned = sqlite3.connect(path)
    assert versioned.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    versioned.close()


def test_a_file_of_a_newer_schema_is_set_aside_too(tmp_path: Path) -> None:
    path = tmp_path / "evidence.sqlite"
    EvidenceLog(path).close()
    newer = sqlite3.connect(path)
    newer.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    newer.close()
    log = EvidenceLog(path)
    assert log.set_aside == tmp_path / f"evidence.sqlite.v{SCHEMA_VERSION + 1}"
    log.close()


def test_a_file_sqlite_cannot_read_is_set_aside_and_learning_starts_over(tmp_path: Path) -> None:
    """Not a database at all (a disk fault, a file copied over it): the cache started before
    only to fail ("DatabaseError: file is not a database", no path named), every restart."""
    path = tmp_path / "evidence.sqlite"
    garbage = bytes(range(256)) * 20
    path.write_bytes(garbage)
    log = EvidenceLog(path)
    assert log.set_aside is not None
    assert log.set_aside.name.startswith("evidence.sqlite.unreadable-")
    assert log.unreadable is not None
    assert "not a database" in log.unreadable
    assert log.set_aside.read_bytes() == garbage  # kept whole, for whoever looks into it
    log.append([Noted("", SCOPE, "a", Observation(0.9, True, 1.0))])
    assert into(Rules(seed=1), log.replay()) == 1
    log.close()


def test_another_programs_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    """HOPLINE_CACHE_VERIFY_STATE naming the milvus-lite file itself (a SQLite database of
    milvus-lite's tables, as here) was taken: the observations table and its schema version
    were written into the running server's database."""
    path = tmp_path / "cache.db"
    other = sqlite3.connect(path)
    other.execute("CREATE TABLE collection_meta (name TEXT)")
    other.execute("CREATE TABLE hopline_cache_all_minilm (pk TEXT)")
    other.commit()
    other.close()
    before = path.read_bytes()
    with pytest.raises(CacheSettingError, match=r"HOPLINE_CACHE_VERIFY_STATE .*cache\.db is "):
        EvidenceLog(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.db"]  # nothing set aside


def test_damaged_pages_found_at_replay_set_the_file_aside_too(tmp_path: Path) -> None:
    """A good header over damaged pages opens; its replay is what fails."""
    path = tmp_path / "evidence.sqlite"
    log = EvidenceLog(path)
    log.append(
        [
            Noted("", f'["t{n % 50}","m","1","{{}}"]', "a", Observation(0.9, True, 1.0))
            for n in range(5000)
        ]
    )
    log.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 8 * 4096
    for page in range(2, len(data) // 4096):
        data[page * 4096 : page * 4096 + 64] = bytes([0xA5]) * 64
    path.write_bytes(bytes(data))
    damaged = EvidenceLog(path)
    assert (damaged.set_aside, damaged.unreadable) == (None, None)  # its header reads well
    assert into(Rules(seed=1), damaged.replay()) == 0
    assert damaged.set_aside is not None
    assert damaged.unreadable is not None
    assert "malformed" in damaged.unreadable
    damaged.append([Noted("", SCOPE, "a", Observation(0.9, True, 1.0))])  # the new file takes them
    damaged.close()
    reopened = EvidenceLog(path)
    assert (reopened.set_aside, into(Rules(seed=1), reopened.replay())) == (None, 1)
    reopened.close()


def test_a_path_sqlite_cannot_open_names_the_setting(tmp_path: Path) -> None:
    """Not set aside: a path that is a directory (or on a read-only disk) is the operator's
    to fix, and nothing there is evidence."""
    path = tmp_path / "evidence.sqlite"
    path.mkdir()
    with pytest.raises(RuntimeError, match=r"HOPLINE_CACHE_VERIFY_STATE .*evidence\.sqlite"):
        EvidenceLog(path)
    assert path.is_dir()


def test_an_unversioned_file_with_these_columns_is_adopted(tmp_path: Path) -> None:
    """Files written before versions were numbered, by this schema, keep their evidence."""
    path = tmp_path / "evidence.sqlite"
    log = EvidenceLog(path)
    log.append([Noted("", SCOPE, "a", Observation(0.9, True, 1.0))])
    log.close()
    unversioned = sqlite3.connect(path)
    unversioned.execute("PRAGMA user_version = 0")
    unversioned.close()
    reopened = EvidenceLog(path)
    assert reopened.set_aside is None
    assert into(Rules(seed=1), reopened.replay()) == 1
    reopened.close()


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
