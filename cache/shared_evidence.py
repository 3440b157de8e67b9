"""Verified-hit evidence in the Milvus server the cache replicas share.

With one SQLite file per replica (cache/evidence.py:EvidenceLog) replicas over one Milvus
server learnt apart, and in Kubernetes, where that file sits on the pod's emptyDir, a rollout
threw away what they had learnt: until a stratum had evidence again, its static threshold
ruled. Here every replica appends its observations to `<collection>_evidence`, replays the
collection at start-up (before SERVING) and reads its peers' new observations every
`HOPLINE_CACHE_PEER_POLL_MS` (as the shared invalidation log, with the same clock window),
so each replica's rule rests on every replica's evidence, and survives them all.

Size: each (scope, stratum) keeps its latest SCOPE_WINDOW observations in the rules; a
replica deletes the rows that have left that window (`trim`), so the collection holds about
one window per stratum, whatever the traffic.

The keys that sign verify ids live in `<collection>_verify_keys`: a replica that finds none,
or finds the newest a day old, adds one; every replica signs with the newest and accepts any
not yet retired (two replicas at once may each add one; cache/verify_ids.py:KEY_ROTATE_S).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hopline.cache.evidence import KEY_BYTES, Noted
from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_log import ROW_VECTOR, MilvusLog
from hopline.cache.milvus_store import CONSISTENCY
from hopline.cache.shared_invalidations import SKEW_S
from hopline.cache.verify import SCOPE_WINDOW, Observation
from hopline.cache.verify_ids import key_due, keys_retired

log = logging.getLogger("hopline.cache.shared_evidence")

_TEXT = 65_535  # a Milvus VARCHAR's limit: a scope or answer longer is kept on this replica
_PAGE = 1_000
_FIELDS = [
    "id",
    "origin",
    "at",
    "scope",
    "region",
    "stratum",
    "similarity",
    "agreed",
    "weight",
    "region_ok",
]


def pool_key(scope: str, stratum: str) -> str:
    """One (scope, stratum) as a fixed-width id a filter can name without quoting."""
    return hashlib.sha256(f"{scope}\0{stratum}".encode()).hexdigest()[:32]


class SharedEvidence:
    """The evidence and key collections, read and written by one replica. Calls block."""

    set_aside: Path | None = None
    unreadable: str | None = None

    def __init__(
        self, uri: str, collection: str, timeout_s: float, access: MilvusAccess = NO_ACCESS
    ) -> None:
        self.collection = f"{collection}_evidence"
        self.key_collection = f"{collection}_verify_keys"
        self.origin = uuid.uuid4().hex
        self._seen: dict[str, float] = {}  # row id -> its stamp, pruned below the window
        self._newest = time.time()
        self._trimmed: dict[tuple[str, str], float] = {}  # cutoffs already applied
        self.milvus = MilvusLog(uri, timeout_s, access)
        self.milvus.open(self.collection, _evidence_fields)
        self.milvus.open(self.key_collection, _key_fields)

    def keys(self, now: float | None = None) -> list[bytes]:
        """The keys verify ids may be signed with, oldest first (the newest signs): a new one
        made when the newest is KEY_ROTATE_S old (or there is none), and those retired
        (`keys_retired`) deleted. Replicas doing this at once each add a key: the newest of
        them signs once every replica has read them, and the others retire."""
        now = time.time() if now is None else now
        rows = self._keys()
        if key_due([r["at"] for r in rows], now):
            key = secrets.token_bytes(KEY_BYTES)
            row = {"id": uuid.uuid4().hex, "vector": ROW_VECTOR, "at": now}
            self.milvus.call("insert", self.key_collection, [row | {"key": key.hex()}])
            rows = self._keys()
        if retired := [rows[i]["id"] for i in keys_retired([r["at"] for r in rows], now)]:
            self.milvus.call("delete", self.key_collection, filter=f"id in {json.dumps(retired)}")
            rows = [r for r in rows if r["id"] not in retired]
        return [bytes.fromhex(r["key"]) for r in rows]

    def _keys(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.milvus.call(
            "query",
            self.key_collection,
            filter='id != ""',
            output_fields=["id", "at", "key"],
            consistency_level=CONSISTENCY,
        )
        return sorted(rows, key=lambda r: (r["at"], r["id"]))

    def append(self, rows: Sequence[Noted]) -> None:
        now = time.time()
        records = []
        for nonce, scope, region, obs in rows:
            if len(scope.encode()) > _TEXT or len(region.encode()) > _TEXT:
                log.warning("evidence too long to share, kept here", extra={"scope": scope[:200]})
                continue
            row_id = nonce or uuid.uuid4().hex
            records.append(
                {
                    "id": row_id,
                    "vector": ROW_VECTOR,
                    "origin": self.origin,
                    "at": obs.at or now,
                    "pool": pool_key(scope, obs.stratum),
                    "scope": scope,
                    "region": region,
                    "stratum": obs.stratum,
                    "similarity": obs.similarity,
                    "agreed": obs.agreed,
                    "weight": obs.weight,
                    "region_ok": obs.region_ok,
                }
            )
            self._seen[row_id] = obs.at or now
        if records:
            self.milvus.call("insert", self.collection, records)

    def replay(self) -> list[Noted]:
        """Every (scope, stratum)'s latest SCOPE_WINDOW rows, oldest first."""
        self._newest = time.time()  # the polls read on from here (less SKEW_S)
        pools: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        pages = self.milvus.call(
            "query_iterator",
            self.collection,
            batch_size=_PAGE,
            filter='id != ""',
            output_fields=_FIELDS,
            consistency_level=CONSISTENCY,
        )
        try:
            while page := self.milvus.guarded(pages.next):
                for row in page:
                    pools[(row["scope"], row["stratum"])].append(row)
        finally:
            pages.close()
        kept = []
        for pool in pools.values():
            pool.sort(key=lambda r: (r["at"], r["id"]))
            kept += pool[-SCOPE_WINDOW:]
        kept.sort(key=lambda r: (r["at"], r["id"]))
        floor = self._newest - 2 * SKEW_S
        self._seen.update((r["id"], r["at"]) for r in kept if r["at"] > floor)
        return [_noted(r) for r in kept]

    def poll(self) -> list[Noted]:
        since = self._newest - SKEW_S
        rows = self.milvus.call(
            "query",
            self.collection,
            filter=f"at > {since!r}",
            output_fields=_FIELDS,
            consistency_level=CONSISTENCY,
        )
        fresh = sorted((r for r in rows if r["id"] not in self._seen), key=lambda r: r["at"])
        out = []
        for row in fresh:
            self._seen[row["id"]] = row["at"]
            self._newest = max(self._newest, row["at"])
            if row["origin"] != self.origin:
                out.append(_noted(row))
        floor = self._newest - 2 * SKEW_S
        self._seen = {k: at for k, at in self._seen.items() if at > floor}
        return out

    def trim(self, cutoffs: dict[tuple[str, str], float]) -> None:
        for pool, cutoff in cutoffs.items():
            if self._trimmed.get(pool, 0.0) >= cutoff:
                continue
            key = pool_key(*pool)
            self.milvus.call(
                "delete", self.collection, filter=f'pool == "{key}" and at < {cutoff!r}'
            )
            self._trimmed[pool] = cutoff

    def forget(self, scopes: Sequence[str]) -> None:
        """Kept: another replica may still use the scope (its rows go with their windows)."""

    def close(self) -> None:
        self.milvus.close()


def _evidence_fields(schema: Any, dt: Any) -> None:
    schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=32)
    schema.add_field("origin", dt.VARCHAR, max_length=32)
    schema.add_field("at", dt.DOUBLE)
    schema.add_field("pool", dt.VARCHAR, max_length=32)
    schema.add_field("scope", dt.VARCHAR, max_length=_TEXT)
    schema.add_field("region", dt.VARCHAR, max_length=_TEXT)
    schema.add_field("stratum", dt.VARCHAR, max_length=64)
    schema.add_field("similarity", dt.DOUBLE)
    schema.add_field("agreed", dt.BOOL)
    schema.add_field("weight", dt.DOUBLE)
    schema.add_field("region_ok", dt.BOOL)


def _key_fields(schema: Any, dt: Any) -> None:
    schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=32)
    schema.add_field("at", dt.DOUBLE)
    schema.add_field("key", dt.VARCHAR, max_length=2 * KEY_BYTES)


def _noted(row: dict[str, Any]) -> Noted:
    obs = Observation(
        float(row["similarity"]),
        bool(row["agreed"]),
        float(row["weight"]),
        bool(row["region_ok"]),
        str(row["stratum"]),
        float(row["at"]),
    )
    return Noted(str(row["id"]), str(row["scope"]), str(row["region"]), obs)
