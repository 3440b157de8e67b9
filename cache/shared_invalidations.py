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
200 ms by default, and the poll's own query waits for one too); a gateway's local copy
follows one watch-stream message later. While the log cannot be read that bound cannot hold:
after HOPLINE_CACHE_PEER_STALE_S a replica stops answering from memory (cache/peer_sync.py).
Stores need no log: an exact lookup that misses a replica's index reads Milvus by key, so a
store through one replica is served by another as soon as its batched write lands; one that
landed after a peer's delete is deleted again when the peer's event is read (peer_sync.py).

Clocks: events are stamped with the writer's wall clock and read back with a window
(`SKEW_S`) below the newest stamp seen, de-duplicated by id, so replicas whose clocks
differ by less than the window miss nothing. Only a milvus-lite file cannot be shared (one
process per file), so the log is used with a server URI only.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from hopline.cache import milvus_log
from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_log import ROW_VECTOR, MilvusLog
from hopline.cache.milvus_store import CONSISTENCY
from hopline.cache.peer_sync import PeerSync
from hopline.protos.hopline.cache.v1 import cache_pb2

log = logging.getLogger("hopline.cache.shared_invalidations")

SKEW_S = 5.0  # clock difference between replicas the log tolerates
KEEP_S = 600.0  # events older than this are deleted (a replica down longer rebuilds its index)
_MAX_EVENT = 65_535  # bytes of one hex-encoded event (a Milvus VARCHAR)
# 64-hex-digit ids take 132 hex characters each once serialised: a long eviction is split.
_IDS_PER_ROW = 400


class SharedInvalidations:
    """The log collection, read and written by one replica (`origin`). Calls block."""

    def __init__(
        self, uri: str, collection: str, timeout_s: float, access: MilvusAccess = NO_ACCESS
    ) -> None:
        self.collection = f"{collection}_invalidations"
        self.origin = uuid.uuid4().hex
        self._seen: dict[str, float] = {}  # event id -> its stamp, pruned below the window
        self._newest = time.time()  # only events from now on: the index was just rebuilt
        self.milvus = MilvusLog(uri, timeout_s, access)
        self.milvus.open(self.collection, _fields)

    def append(self, event: cache_pb2.WatchInvalidationsResponse) -> None:
        """Record an event for the other replicas; returns once a Strong read would see it."""
        now = time.time()
        rows = [
            {
                "id": uuid.uuid4().hex,
                "vector": ROW_VECTOR,
                "origin": self.origin,
                "at": now,
                "event": part.SerializeToString().hex(),
            }
            for part in _split(event)
        ]
        self.milvus.call("insert", self.collection, rows)
        self._seen.update((str(row["id"]), now) for row in rows)

    def poll(self) -> list[cache_pb2.WatchInvalidationsResponse]:
        """Other replicas' events not seen before, oldest first."""
        since = self._newest - SKEW_S
        rows = self.milvus.call(
            "query",
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
        self.milvus.call("delete", self.collection, filter=f"at < {time.time() - KEEP_S!r}")

    def close(self) -> None:
        self.milvus.close()


def _fields(schema: Any, dt: Any) -> None:
    schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=32)
    schema.add_field("origin", dt.VARCHAR, max_length=32)
    schema.add_field("at", dt.DOUBLE)
    schema.add_field("event", dt.VARCHAR, max_length=_MAX_EVENT)


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
    sync: PeerSync,
    start_over: Callable[[float], None],
    poll_s: float,
) -> None:
    """Apply the other replicas' events every `poll_s`, for good; `run` runs a blocking call.
    Each read is told to `sync`; after a gap the log's history may not cover, `start_over`
    (with the gap in seconds) empties memory before the events are applied."""

    async def poll() -> None:
        started = time.monotonic()
        events = await run(shared.poll)
        gap = started - sync.read_at
        if sync.outlived_history(gap):
            start_over(gap)
        for event in events:
            apply(event)
        declared = sync.watches_ended  # read() clears it
        sync.read(started)
        if declared:
            log.info(
                "the other replicas' invalidations read again: memory answers again",
                extra={"unread_s": round(gap, 1)},
            )

    async def trim() -> None:
        await run(shared.trim)

    await milvus_log.follow("the shared invalidation log", poll, trim, poll_s)
