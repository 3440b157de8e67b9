"""Verify ids (cache/verify_ids.py): any replica holding the shared keys takes an id another
issued, once; a changed, foreign, expired or made-up id is refused with the reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hopline.cache.evidence import EvidenceLog
from hopline.cache.verify import VerifyPolicy
from hopline.cache.verify_ids import (
    KEY_RETIRE_S,
    KEY_ROTATE_S,
    PENDING_TTL_S,
    BadVerifyId,
    Pending,
    UnknownKey,
    UnknownVerifyId,
    VerifyIds,
    key_due,
    keys_retired,
    new_nonce,
)

KEY = b"k" * 32
NOW = 1_800_000_000.0
POLICY = VerifyPolicy(target=0.01, confidence=0.9, prior_threshold=0.85, floor=0.55)


def pending(tenant: str = "acme", created: float = NOW) -> Pending:
    scope = (tenant, "support-intents", "1", '{"top_k":"3"}')
    return Pending(new_nonce(), scope, "reset_password", "2+0", 0.8731, 4.0, POLICY, created)


def test_another_replica_with_the_shared_keys_takes_the_id_once() -> None:
    issued = pending()
    verify_id = VerifyIds([KEY]).issue(issued)
    peer = VerifyIds([b"newer" * 7, KEY])  # knows the signer's key among others
    assert peer.open(verify_id, NOW + 1) == issued
    with pytest.raises(UnknownVerifyId, match="reported already"):
        peer.open(verify_id, NOW + 2)


def test_an_id_a_peer_took_is_refused_here() -> None:
    issued = pending()
    verify_id = VerifyIds([KEY]).issue(issued)
    here = VerifyIds([KEY])
    here.taken(issued.nonce, issued.created, NOW + 1)  # the peer's evidence row, polled
    with pytest.raises(UnknownVerifyId, match="reported already"):
        here.open(verify_id, NOW + 2)


def test_an_id_signed_with_a_key_this_replica_lacks_is_unknown_until_it_learns_it() -> None:
    verify_id = VerifyIds([KEY]).issue(pending())
    other = VerifyIds([b"o" * 32])
    with pytest.raises(UnknownKey, match="shares no evidence store"):
        other.open(verify_id, NOW)
    other.learn([b"o" * 32, KEY])
    assert other.open(verify_id, NOW).region == "reset_password"


def test_an_id_changed_to_name_another_tenant_is_refused() -> None:
    ids = VerifyIds([KEY])
    verify_id = ids.issue(pending("acme"))
    forged = ids.issue(pending("globex"))
    version, kid, _, mac = verify_id.split(".")
    spliced = ".".join((version, kid, forged.split(".")[2], mac))
    with pytest.raises(BadVerifyId, match="signature"):
        ids.open(spliced, NOW)


@pytest.mark.parametrize("text", ["0" * 32, "", "1.x.y", "1.abc.%%%.%%%", "2.a.b.c"])
def test_a_string_no_cache_issued_is_a_bad_argument(text: str) -> None:
    ids = VerifyIds([KEY])
    with pytest.raises((BadVerifyId, UnknownKey)):
        ids.open(text, NOW)


def test_an_id_past_its_time_is_refused() -> None:
    ids = VerifyIds([KEY])
    verify_id = ids.issue(pending(created=NOW))
    with pytest.raises(UnknownVerifyId, match="expired"):
        ids.open(verify_id, NOW + PENDING_TTL_S + 1)


def test_the_policy_travels_whole() -> None:
    policy = dataclasses.replace(POLICY, min_rate=0.2, explore=7.5)
    issued = dataclasses.replace(pending(), policy=policy)
    ids = VerifyIds([KEY])
    assert ids.open(ids.issue(issued), NOW).policy == policy


def test_the_newest_key_signs_and_a_retired_one_opens_nothing() -> None:
    old, new = b"o" * 32, b"n" * 32
    ids = VerifyIds([old])
    signed_old = ids.issue(pending())
    ids.learn([old, new])  # a key was added: it signs from now on
    signed_new = ids.issue(pending())
    assert signed_new.split(".")[1] != signed_old.split(".")[1]
    assert VerifyIds([new]).open(signed_new, NOW).region == "reset_password"
    assert ids.open(signed_old, NOW).region == "reset_password"  # still known
    ids.learn([new])  # the old key retired from the store
    with pytest.raises(UnknownKey):
        ids.open(VerifyIds([old]).issue(pending()), NOW)


def test_a_key_is_due_daily_and_retired_once_no_id_it_signed_can_be_taken() -> None:
    assert key_due([], NOW)
    assert not key_due([NOW], NOW + KEY_ROTATE_S - 1)
    assert key_due([NOW], NOW + KEY_ROTATE_S)
    made = [NOW, NOW + KEY_ROTATE_S, NOW + 2 * KEY_ROTATE_S]
    # An id signed with a key just before its successor came lives PENDING_TTL_S more.
    assert KEY_RETIRE_S > PENDING_TTL_S
    assert keys_retired(made, NOW + KEY_ROTATE_S + KEY_RETIRE_S - 1) == []
    assert keys_retired(made, NOW + KEY_ROTATE_S + KEY_RETIRE_S) == [0]
    assert keys_retired(made, NOW + 2 * KEY_ROTATE_S + KEY_RETIRE_S) == [0, 1]  # never the newest


def test_one_process_rotates_its_own_keys(tmp_path: Path) -> None:
    log = EvidenceLog(tmp_path / "verify.sqlite")
    try:
        first = log.keys(NOW)
        assert len(first) == 1
        assert log.keys(NOW + 10) == first
        rotated = log.keys(NOW + KEY_ROTATE_S)
        assert rotated[0] == first[0]
        assert len(rotated) == 2
        assert log.keys(NOW + KEY_ROTATE_S + KEY_RETIRE_S) == rotated[1:]
    finally:
        log.close()
