"""Verify ids any cache replica can take: the awaited comparison travels in the id, signed.

A lookup whose candidate the rule wants checked hands the caller a `verify_id`; the caller
sends it back with the model's answer (ReportVerification). Behind a load balancer that
report reaches any replica, not necessarily the one that issued the id (the gateway's
channel to `dns:///cache` is round_robin), so an id that only named a record in the issuing
process was NOT_FOUND on every other replica: with two cache pods, half the evidence lost.

So the id carries what the comparison needs (the scope, the candidate's answer, stratum,
similarity, weight and the policy it was decided under, when it was issued) and an HMAC
under a key the replicas share through their evidence store (a Milvus server's
`<collection>_verify_keys`, or the SQLite evidence file for one process), which also keeps
ids valid across a restart. The signature is what keeps a caller from writing evidence into
a scope it was never handed an id for (another tenant's).

An id is taken once: each replica remembers the ids reported to it, and those its peers
reported (their evidence rows carry the id's nonce), until the id expires (PENDING_TTL_S).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import secrets
from collections import OrderedDict
from collections.abc import Sequence

from hopline.cache.verify import VerifyPolicy

PENDING_MAX = 100_000  # ids remembered as reported; past it the oldest issued are refused
PENDING_TTL_S = 300.0  # an id not reported by then is refused
# A new signing key every KEY_ROTATE_S (the newest signs), so that a key read out of a
# replica's memory or the evidence store signs for a day, not for ever. A key is deleted once
# no id it signed can still be taken: its successor has been in the store for an id's life,
# plus the time a replica may go on signing with it before it reads the keys again
# (KEYS_READ_S), plus the clock skew allowed between replicas.
KEY_ROTATE_S = 86_400.0
KEYS_READ_S = 60.0
KEY_SKEW_S = 60.0
KEY_RETIRE_S = PENDING_TTL_S + KEYS_READ_S + KEY_SKEW_S
VERSION = "1"
_MAC_BYTES = 16


class UnknownVerifyId(LookupError):
    """The id cannot be taken (NOT_FOUND): reported already, expired, or signed by a key
    this replica does not know; the message says which."""


class UnknownKey(UnknownVerifyId):
    """Signed by a key this replica has not read from the store (yet)."""


class BadVerifyId(ValueError):
    """The string is not a verify id a cache issued (INVALID_ARGUMENT)."""


@dataclasses.dataclass(frozen=True)
class Pending:
    """A comparison awaited: what the id carries."""

    nonce: str
    scope: tuple[str, str, str, str]
    region: str  # the candidate's answer
    stratum: str  # its runner-ups' agreement (cache/verify.py:stratum)
    similarity: float
    weight: float
    policy: VerifyPolicy
    created: float  # wall clock: ids cross processes


def key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:12]


def key_due(made: Sequence[float], now: float) -> bool:
    """Whether a new key is due, for keys made at the wall-clock times `made`, oldest first."""
    return not made or now - made[-1] >= KEY_ROTATE_S


def keys_retired(made: Sequence[float], now: float) -> list[int]:
    """The positions of the keys (made at `made`, oldest first) no id can still be signed by:
    each one's successor is KEY_RETIRE_S old."""
    return [i for i in range(len(made) - 1) if now - made[i + 1] >= KEY_RETIRE_S]


class VerifyIds:
    """Issues and opens verify ids under a set of shared keys (the newest signs)."""

    def __init__(self, keys: list[bytes]) -> None:
        self._keys: dict[str, bytes] = {}
        self._signer = ""
        self.learn(keys)
        self._taken: OrderedDict[str, float] = OrderedDict()  # nonce -> issued at
        self._floor = 0.0  # ids issued at or before this were forgotten: refused

    def learn(self, keys: list[bytes]) -> None:
        """The store's keys, oldest first: the newest signs from now on, and a key the store
        no longer holds (retired) opens no id from now on."""
        if keys:
            self._keys = {key_id(key): key for key in keys}
            self._signer = key_id(keys[-1])

    def issue(self, pending: Pending) -> str:
        body = json.dumps(
            [
                pending.nonce,
                pending.created,
                list(pending.scope),
                pending.region,
                pending.stratum,
                pending.similarity,
                pending.weight,
                _policy_fields(pending.policy),
            ],
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
        payload = _b64(body)
        head = f"{VERSION}.{self._signer}.{payload}"
        return f"{head}.{_b64(self._mac(self._keys[self._signer], head))}"

    def open(self, verify_id: str, now: float) -> Pending:
        """The comparison `verify_id` awaits, taken: a second open of it is refused."""
        pending = self.read(verify_id)
        if now - pending.created > PENDING_TTL_S or pending.created <= self._floor:
            raise UnknownVerifyId(
                f"verify_id {_clip(verify_id)!r} expired: a verify_id is taken within "
                f"{PENDING_TTL_S:.0f} s of its lookup"
            )
        if pending.nonce in self._taken:
            raise UnknownVerifyId(f"verify_id {_clip(verify_id)!r} was reported already")
        self.taken(pending.nonce, pending.created, now)
        return pending

    def read(self, verify_id: str) -> Pending:
        """The id's contents, its signature checked; nothing taken."""
        parts = verify_id.split(".")
        if len(parts) != 4 or parts[0] != VERSION:
            raise BadVerifyId(
                f"verify_id {_clip(verify_id)!r} is not one a cache issued; send the "
                "verify_id of a recent lookup as it came"
            )
        version, kid, payload, mac = parts
        key = self._keys.get(kid)
        if key is None:
            raise UnknownKey(
                f"verify_id {_clip(verify_id)!r} was issued by a cache that shares no evidence "
                "store with this one (another Milvus, or a milvus-lite file since replaced)"
            )
        try:
            good = hmac.compare_digest(_unb64(mac), self._mac(key, f"{version}.{kid}.{payload}"))
            fields = json.loads(_unb64(payload)) if good else None
        except (binascii.Error, ValueError) as exc:
            raise BadVerifyId(f"verify_id {_clip(verify_id)!r} is damaged: {exc}") from exc
        if fields is None:
            raise BadVerifyId(
                f"verify_id {_clip(verify_id)!r} does not carry a cache's signature; send the "
                "verify_id of a recent lookup unchanged"
            )
        nonce, created, scope, region, stratum, similarity, weight, policy = fields
        return Pending(
            nonce,
            (scope[0], scope[1], scope[2], scope[3]),
            region,
            stratum,
            similarity,
            weight,
            VerifyPolicy(*policy),
            created,
        )

    def taken(self, nonce: str, created: float, now: float) -> None:
        """Remember `nonce` as reported (here or by a peer) until its id expires."""
        self._taken[nonce] = created
        self._taken.move_to_end(nonce)
        while self._taken:
            oldest_nonce, oldest = next(iter(self._taken.items()))
            full = len(self._taken) > PENDING_MAX
            if not full and now - oldest <= PENDING_TTL_S:
                return
            del self._taken[oldest_nonce]
            if full:  # forgotten before it expired: a repeat could no longer be told apart
                self._floor = max(self._floor, oldest)

    @staticmethod
    def _mac(key: bytes, head: str) -> bytes:
        return hmac.new(key, head.encode(), hashlib.sha256).digest()[:_MAC_BYTES]


def _policy_fields(policy: VerifyPolicy) -> list[float]:
    # Not dataclasses.astuple: its deep copy made an id cost 38 us here instead of 16-20.
    return [getattr(policy, field.name) for field in _POLICY_FIELDS]


_POLICY_FIELDS = dataclasses.fields(VerifyPolicy)


def new_nonce() -> str:
    return secrets.token_hex(16)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _clip(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
