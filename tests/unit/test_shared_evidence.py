"""The shared evidence store (cache/shared_evidence.py) on milvus-lite's own server process
(or the Milvus server HOPLINE_TEST_MILVUS names, in `make milvus-server-tests`), two stores in
one process standing in for two replicas (the mesh test tests/mesh/test_cache_shared_milvus.py
runs replica processes over a server): what one appends the other polls, a new store replays
the latest window per stratum, the rows past a window are trimmed, an id two replicas took at
once counts once, and the replicas agree on the key that signs verify ids and rotate it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from milvus_server import MilvusKind, MilvusServer, chosen_kind

from hopline.cache.evidence import Noted
from hopline.cache.shared_evidence import SharedEvidence
from hopline.cache.verify import Observation, Rules
from hopline.cache.verify_ids import KEY_RETIRE_S, KEY_ROTATE_S, new_nonce

SCOPE = '["t","m","1","{}"]'
BASE = 0.0


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Milvus server for the module (milvus-lite's own process by default, as the store
    is used only over a server URI); each test names collections of its own."""
    work = tmp_path_factory.mktemp("shared-evidence")
    kind = chosen_kind()
    server = MilvusServer(
        work / "milvus", MilvusKind.LITE_SERVER if kind is MilvusKind.FILE else kind
    ).start()
    try:
        yield server.uri
    finally:
        server.stop()


def began() -> None:
    global BASE
    BASE = time.time()


def noted(i: int, stratum: str = "2+0", agreed: bool = True) -> Noted:
    """The i-th observation, made i ms after BASE (set once the test's stores are open: a
    poll reads the last seconds)."""
    return Noted(
        new_nonce(), SCOPE, "a", Observation(0.9, agreed, 1.0, True, stratum, BASE + i / 1000)
    )


def test_one_replicas_evidence_reaches_the_other_and_a_newcomer(uri: str) -> None:
    first = SharedEvidence(uri, "c1", 10.0)
    second = SharedEvidence(uri, "c1", 10.0)
    try:
        assert second.poll() == []
        began()
        rows = [noted(i, agreed=i != 3) for i in range(5)]
        first.append(rows)
        assert first.poll() == []  # its own rows are not news to it
        polled = second.poll()
        assert [r.nonce for r in polled] == [r.nonce for r in rows]
        assert polled[3].obs == rows[3].obs
        assert second.poll() == []  # each row once
        third = SharedEvidence(uri, "c1", 10.0)
        assert [r.nonce for r in third.replay()] == [r.nonce for r in rows]
        third.close()
    finally:
        first.close()
        second.close()


def test_one_id_reported_to_two_replicas_at_once_counts_once_everywhere(uri: str) -> None:
    """A gateway that retries a report on another replica (the first answered too late) can
    have both take the id before either reads the other's row: each has counted its own, so
    neither may count the peer's, and the store keeps one row for a newcomer."""
    first = SharedEvidence(uri, "c4", 10.0)
    second = SharedEvidence(uri, "c4", 10.0)
    try:
        began()
        mine = noted(0)
        theirs = mine._replace(obs=Observation(0.9, False, 1.0, True, "2+0", BASE + 0.002))
        first.append([mine])
        second.append([theirs])
        assert first.poll() == []
        assert second.poll() == []
        third = SharedEvidence(uri, "c4", 10.0)
        assert [r.nonce for r in third.replay()] == [mine.nonce]
        third.close()
    finally:
        first.close()
        second.close()


def test_the_replicas_sign_with_one_key(uri: str) -> None:
    first = SharedEvidence(uri, "c2", 10.0)
    second = SharedEvidence(uri, "c2", 10.0)
    try:
        assert first.keys() == second.keys()
        assert len(first.keys()) == 1
    finally:
        first.close()
        second.close()


def test_the_replicas_rotate_the_shared_key_and_retire_the_old_one(uri: str) -> None:
    """A day on (the clocks given), the first replica to read the keys adds one, which the
    other reads too; once no id the old key signed can still be taken, it is deleted."""
    first = SharedEvidence(uri, "c5", 10.0)
    second = SharedEvidence(uri, "c5", 10.0)
    try:
        now = time.time()
        (old,) = first.keys(now)
        assert second.keys(now + KEY_ROTATE_S - 1) == [old]
        rotated = first.keys(now + KEY_ROTATE_S)
        assert rotated[0] == old
        assert len(rotated) == 2
        assert second.keys(now + KEY_ROTATE_S + 1) == rotated
        retired = second.keys(now + KEY_ROTATE_S + KEY_RETIRE_S)
        assert retired == rotated[1:]
        assert first.keys(now + KEY_ROTATE_S + KEY_RETIRE_S + 1) == retired
    finally:
        first.close()
        second.close()


def test_a_replay_keeps_each_strata_latest_window_and_trim_drops_the_rest(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hopline.cache.shared_evidence.SCOPE_WINDOW", 4)
    monkeypatch.setattr("hopline.cache.verify.SCOPE_WINDOW", 4)
    store = SharedEvidence(uri, "c3", 10.0)
    began()
    try:
        store.append([noted(i, "2+0") for i in range(10)] + [noted(i, "0+2") for i in range(3)])
        replayed = store.replay()
        kept = sorted((r.obs.stratum, r.obs.at) for r in replayed)
        assert kept == [("0+2", BASE + i / 1000) for i in range(3)] + [
            ("2+0", BASE + i / 1000) for i in range(6, 10)
        ]
        rules = Rules()
        for _, scope, region, obs in replayed:
            rules.evidence(scope).add(region, obs)
        cutoffs = rules.cutoffs()
        assert cutoffs == {(SCOPE, "2+0"): BASE + 6 / 1000}  # "0+2" is not full: nothing leaves it
        store.trim(cutoffs)
        monkeypatch.setattr("hopline.cache.shared_evidence.SCOPE_WINDOW", 100)
        left = SharedEvidence(uri, "c3", 10.0)
        assert len(left.replay()) == 7  # 13 before the trim
        left.close()
    finally:
        store.close()
