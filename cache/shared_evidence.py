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

The keys that sign verify ids live in `<collection>_verify_keys`: a replica that finds none
adds its own; every replica signs with the oldest and accepts any (two replicas starting at
once may each add one).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from hopline.cache.evidence import KEY_BYTES, Noted
from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_connection import MilvusConnection
from hopline.cache.milvus_store import CONSISTENCY, milvus_reason, quiet_pymilvus
from hopline.cache.shared_invalidations import SKEW_S
from hopline.cache.store import CacheStoreError
from hopline.cache.verify import SCOPE_WINDOW, Observation

log = logging.getLogger("hopline.cache.shared_evidence")

_DIM = 2  # Milvus wants a vector field in every collection; these are never searched
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
        self.uri = uri
        self.collection = f"{collection}_evidence"
        self.key_collection = f"{collection}_verify_keys"
        self.timeout_s = timeout_s
        self.origin = uuid.uuid4().hex
        self._seen: dict[str, float] = {}  # row id -> its stamp, pruned below the window
        self._newest = time.time()
        self._trimmed: dict[tuple[str, str], float] = {}  # cutoffs already applied
        pymilvus = quiet_pymilvus()
        self._pymilvus = pymilvus
        self._exc: type[Exception] = pymilvus.MilvusException
        try:
            self._connection = MilvusConnection(
                lambda access: pymilvus.MilvusClient(
                    uri, timeout=timeout_s, dedicated=True, **access.client_kwargs()
                ),
                access,
                describe=milvus_reason,
            )
            self._open(self.collection, self._evidence_fields)
            self._open(self.key_collection, self._key_fields)
        except (self._exc, grpc.RpcError) as exc:
            raise CacheStoreError(f"Milvus at {uri}: {milvus_reason(exc)}") from exc

    def _evidence_fields(self, schema: Any, dt: Any) -> None:
        schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=32)
        schema.add_field("vector", dt.FLOAT_VECTOR, dim=_DIM)
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

    def _key_fields(self, schema: Any, dt: Any) -> None:
        schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=32)
        schema.add_field("vector", dt.FLOAT_VECTOR, dim=_DIM)
        schema.add_field("at", dt.DOUBLE)
        schema.add_field("key", dt.VARCHAR, max_length=2 * KEY_BYTES)

    def _open(self, name: str, fields: Callable[[Any, Any], None]) -> None:
        """The collection `name` (made with `fields` if it is not there yet), loaded."""
        client = self._client
        if not client.has_collection(name, timeout=self.timeout_s):
            schema = self._pymilvus.MilvusClient.create_schema(
                auto_id=False, enable_dynamic_field=False
            )
            fields(schema, self._pymilvus.DataType)
            index = client.prepare_index_params()
            index.add_index(field_name="vector", index_type="AUTOINDEX", metric_type="L2")
            try:
                client.create_collection(
                    name,
                    schema=schema,
                    index_params=index,
                    consistency_level=CONSISTENCY,
                    timeout=self.timeout_s * 6,
                )
                log.info("created a shared evidence collection", extra={"collection": name})
            except self._exc:
                # Another replica created it between our check and our create: use theirs.
                if not client.has_collection(name, timeout=self.timeout_s):
                    raise
        client.load_collection(name, timeout=self.timeout_s * 6)

    def keys(self) -> list[bytes]:
        rows = self._keys()
        if not rows:
            key = secrets.token_bytes(KEY_BYTES)
            row = {"id": uuid.uuid4().hex, "vector": [1.0, 0.0], "at": time.time()}
            self._call(self._client.insert, self.key_collection, [row | {"key": key.hex()}])
            rows = self._keys()
        return [bytes.fromhex(r["key"]) for r in sorted(rows, key=lambda r: (r["at"], r["id"]))]

    def _keys(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self._call(
            self._client.query,
            self.key_collection,
            filter='id != ""',
            output_fields=["id", "at", "key"],
            consistency_level=CONSISTENCY,
        )
        return rows

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
                    "vector": [1.0, 0.0],
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
            self._call(self._client.insert, self.collection, records)

    def replay(self) -> list[Noted]:
        """Every (scope, stratum)'s latest SCOPE_WINDOW rows, oldest first."""
        self._newest = time.time()  # the polls read on from here (less SKEW_S)
        pools: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        try:
            pages = self._client.query_iterator(
                self.collection,
                batch_size=_PAGE,
                filter='id != ""',
                output_fields=_FIELDS,
                consistency_level=CONSISTENCY,
                timeout=self.timeout_s,
            )
            try:
                while page := pages.next():
                    for row in page:
                        pools[(row["scope"], row["stratum"])].append(row)
            finally:
                pages.close()
        except (self._exc, grpc.RpcError) as exc:
            raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}") from exc
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
        rows = self._call(
            self._client.query,
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
            self._call(
                self._client.delete, self.collection, filter=f'pool == "{key}" and at < {cutoff!r}'
            )
            self._trimmed[pool] = cutoff

    @property
    def _client(self) -> Any:
        """The client to call now: dialled again when the credentials' files change."""
        return self._connection.client

    def close(self) -> None:
        self._connection.close()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, timeout=self.timeout_s, **kwargs)
        except (self._exc, grpc.RpcError) as exc:
            raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}") from exc


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
