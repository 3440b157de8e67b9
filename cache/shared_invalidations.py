"""Invalidations shared by cache replicas over one Milvus server.

Two memories sit in front of Milvus: each cache replica's exact index (cache/exact_index.py)
and each gateway's local exact tier (gateway/exact_tier.py), which hears only the replica its
WatchInvalidations stream reached. Deleting from Milvus reaches neither on another replica, so
every invalidation and eviction is also appended to a small log collection in the same Milvus
(`<collection>_invalidations`), and every replica tails it: a peer's event drops the entries
from its own index and pending stores and goes out on its own watch streams, exactly as if
the Invalidate had come to it.

Freshness bound: an Invalidate has returned only after its event is in the log, and each
replica reads the log every `poll_s` with Strong consistency, so another replica stops
serving the entries within one poll and one log query after the call returned (on a Milvus
standalone a Strong query waits for the server's next time tick, proxy.timeTickInterval,
200 ms by default); a gateway's local copy follows one watch-stream message later. Stores
need no log: an exact lookup that misses a replica's index reads Milvus by key, so a store
through one replica is served by another as soon as its batched write lands.

Clocks: events are stamped with the writer's wall clock and read back with a window
(`SKEW_S`) below the newest stamp seen, de-duplicated by id, so replicas whose clocks
differ by less than the window miss nothing. Only a milvus-lite file cannot be shared (one
process per file), so the log is used with a server URI only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_connection import MilvusConnection
from hopline.cache.milvus_store import CONSISTENCY, milvus_reason, quiet_pymilvus
from hopline.cache.store import CacheStoreError
from hopline.protos.hopline.cache.v1 import cache_pb2

log = logging.getLogger("hopline.cache.shared_invalidations")

SKEW_S = 5.0  # clock difference between replicas the log tolerates
TRIM_EVERY_S = 60.0
KEEP_S = 600.0  # events older than this are deleted (a replica down longer rebuilds its index)
_DIM = 2  # Milvus wants a vector field in every collection; this one is never searched
_MAX_EVENT = 65_535  # bytes of one hex-encoded event (a Milvus VARCHAR)
# 64-hex-digit ids take 132 hex characters each once serialised: a long eviction is split.
_IDS_PER_ROW = 400


class SharedInvalidations:
    """The log collection, read and written by one replica (`origin`). Calls block."""

    def __init__(
        self, uri: str, collection: str, timeout_s: float, access: MilvusAccess = NO_ACCESS
    ) -> None:
        self.uri = uri
        self.collection = f"{collection}_invalidations"
        self.timeout_s = timeout_s
        self.origin = uuid.uuid4().hex
        self._seen: dict[str, float] = {}  # event id -> its stamp, pruned below the window
        self._newest = time.time()  # only events from now on: the index was just rebuilt
        pymilvus = quiet_pymilvus()
        self._exc: type[Exception] = pymilvus.MilvusException
        try:
            self._connection = MilvusConnection(
                lambda access: pymilvus.MilvusClient(
                    uri, timeout=timeout_s, dedicated=True, **access.client_kwargs()
                ),
                access,
                describe=milvus_reason,
            )
            if not self._client.has_collection(self.collection, timeout=timeout_s):
                self._create(pymilvus)
            self._client.load_collection(self.collection, timeout=timeout_s * 6)
        except (self._exc, grpc.RpcError) as exc:
            raise CacheStoreError(f"Milvus at {uri}: {milvus_reason(exc)}") from exc

    def _create(self, pymilvus: Any) -> None:
        dt = pymilvus.DataType
        schema = pymilvus.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=32)
        schema.add_field("vector", dt.FLOAT_VECTOR, dim=_DIM)
        schema.add_field("origin", dt.VARCHAR, max_length=32)
        schema.add_field("at", dt.DOUBLE)
        schema.add_field("event", dt.VARCHAR, max_length=_MAX_EVENT)
        index = self._client.prepare_index_params()
        index.add_index(field_name="vector", index_type="AUTOINDEX", metric_type="L2")
        try:
            self._client.create_collection(
                self.collection,
                schema=schema,
                index_params=index,
                consistency_level=CONSISTENCY,
                timeout=self.timeout_s * 6,
            )
        except self._exc:
            # Another replica created it between our check and our create: use theirs.
            if not self._client.has_collection(self.collection, timeout=self.timeout_s):
                raise
        log.info("created the shared invalidation log", extra={"collection": self.collection})

    def append(self, event: cache_pb2.WatchInvalidationsResponse) -> None:
        """Record an event for the other replicas; returns once a Strong read would see it."""
        now = time.time()
        rows = [
            {
                "id": uuid.uuid4().hex,
                "vector": [1.0, 0.0],
                "origin": self.origin,
                "at": now,
                "event": part.SerializeToString().hex(),
            }
            for part in _split(event)
        ]
        self._call(self._client.insert, self.collection, rows)
        self._seen.update((str(row["id"]), now) for row in rows)

    def poll(self) -> list[cache_pb2.WatchInvalidationsResponse]:
        """Other replicas' events not seen before, oldest first."""
        since = self._newest - SKEW_S
        rows = self._call(
            self._client.query,
            self.collection,
            filter=f"at > {since!r}",
            output_fields=["id", "origin", "at", "event"],
            consistency_level=CONSISTENCY,
        )
        fresh = sorted(
            (r for r in rows if str(r["id"]) not in self._seen), key=lambda r: float(r["at"])
        )
        events = []
        for row in fresh:
            stamp = float(row["at"])
            self._seen[str(row["id"])] = stamp
            self._newest = max(self._newest, stamp)
            if row["origin"] != self.origin:
                events.append(
                    cache_pb2.WatchInvalidationsResponse.FromString(bytes.fromhex(row["event"]))
                )
        floor = self._newest - 2 * SKEW_S
        self._seen = {k: at for k, at in self._seen.items() if at > floor}
        return events

    def trim(self) -> None:
        self._call(self._client.delete, self.collection, filter=f"at < {time.time() - KEEP_S!r}")

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


def _split(
    event: cache_pb2.WatchInvalidationsResponse,
) -> list[cache_pb2.WatchInvalidationsResponse]:
    ids = list(event.entry_ids)
    if len(ids) <= _IDS_PER_ROW:
        return [event]
    parts = [
        cache_pb2.WatchInvalidationsResponse(entry_ids=ids[i : i + _IDS_PER_ROW])
        for i in range(0, len(ids), _IDS_PER_ROW)
    ]
    if event.HasField("scope"):
        parts[0].scope.CopyFrom(event.scope)
    return parts


async def follow(
    shared: SharedInvalidations,
    run: Callable[[Callable[[], Any]], Awaitable[Any]],
    apply: Callable[[cache_pb2.WatchInvalidationsResponse], None],
    poll_s: float,
) -> None:
    """Apply the other replicas' events every `poll_s`, for good; `run` runs a blocking call."""
    trimmed = time.monotonic()
    failing = False
    while True:
        await asyncio.sleep(poll_s)
        try:
            for event in await run(shared.poll):
                apply(event)
            if time.monotonic() - trimmed > TRIM_EVERY_S:
                trimmed = time.monotonic()
                await run(shared.trim)
        except CacheStoreError as exc:
            # Said once per outage: while Milvus is unreachable the bound above does not hold
            # for entries this replica's index answers on its own.
            if not failing:
                log.warning("reading the shared invalidation log failed", extra={"error": str(exc)})
            failing = True
            continue
        if failing:
            log.info("reading the shared invalidation log again")
        failing = False
