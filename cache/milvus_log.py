"""What the cache replicas' shared logs in one Milvus server have in common.

Two logs ride on the Milvus server the replicas share: invalidations
(cache/shared_invalidations.py) and verified-hit evidence (cache/shared_evidence.py). Each is
a small collection (or two) that every replica appends to and polls; `MilvusLog` is their
client (made once per replica, credentials re-read as they change, every failure a
CacheStoreError naming the server), and `follow` the loop that polls one for good.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess
from hopline.cache.milvus_connection import MilvusConnection
from hopline.cache.milvus_index import IndexNotBuilt, create_indexed
from hopline.cache.milvus_store import CONSISTENCY, milvus_reason, quiet_pymilvus
from hopline.cache.store import CacheStoreError

log = logging.getLogger("hopline.cache.milvus_log")
T = TypeVar("T")

DIM = 2  # Milvus wants a vector field in every collection; these are never searched
ROW_VECTOR = [1.0, 0.0]
TRIM_EVERY_S = 60.0  # how often `follow` trims its log

# Adds a collection's fields to a pymilvus schema: (schema, pymilvus.DataType).
Fields = Callable[[Any, Any], None]


class MilvusLog:
    """A blocking client of one Milvus server for a replica's shared logs."""

    def __init__(self, uri: str, timeout_s: float, access: MilvusAccess = NO_ACCESS) -> None:
        self.uri = uri
        self.timeout_s = timeout_s
        self._pymilvus = pymilvus = quiet_pymilvus()
        self._exc: type[Exception] = pymilvus.MilvusException
        try:
            self._connection = MilvusConnection(
                lambda access: pymilvus.MilvusClient(
                    uri, timeout=timeout_s, dedicated=True, **access.client_kwargs()
                ),
                access,
                describe=milvus_reason,
            )
        except (self._exc, grpc.RpcError) as exc:
            raise CacheStoreError(f"Milvus at {uri}: {milvus_reason(exc)}") from exc

    def open(self, name: str, fields: Fields) -> None:
        """The collection `name` (made with `fields` if it is not there yet), loaded."""
        try:
            if not self._client.has_collection(name, timeout=self.timeout_s):
                self._create(name, fields)
            self._client.load_collection(name, timeout=self.timeout_s * 6)
        except (self._exc, grpc.RpcError, IndexNotBuilt) as exc:
            raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}") from exc

    def _create(self, name: str, fields: Fields) -> None:
        schema = self._pymilvus.MilvusClient.create_schema(
            auto_id=False, enable_dynamic_field=False
        )
        fields(schema, self._pymilvus.DataType)
        schema.add_field("vector", self._pymilvus.DataType.FLOAT_VECTOR, dim=DIM)
        index = self._client.prepare_index_params()
        index.add_index(field_name="vector", index_type="AUTOINDEX", metric_type="L2")
        try:
            create_indexed(
                self._client,
                name,
                schema=schema,
                index_params=index,
                consistency_level=CONSISTENCY,
                timeout_s=self.timeout_s * 6,
            )
        except self._exc:
            # Another replica created it between our check and our create: use theirs.
            if not self._client.has_collection(name, timeout=self.timeout_s):
                raise
        log.info("created a shared log collection", extra={"collection": name})

    @property
    def _client(self) -> Any:
        """The client to call now: dialled again when the credentials' files change."""
        return self._connection.client

    def close(self) -> None:
        self._connection.close()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The client's `method`, bounded by the timeout; CacheStoreError on failure."""
        method_now = getattr(self._client, method)
        return self.guarded(lambda: method_now(*args, timeout=self.timeout_s, **kwargs))

    def guarded(self, fn: Callable[[], T]) -> T:
        """`fn()`, a call into pymilvus (a query iterator's next page): CacheStoreError on
        failure."""
        try:
            return fn()
        except (self._exc, grpc.RpcError) as exc:
            raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}") from exc


async def follow(
    what: str,
    poll: Callable[[], Awaitable[None]],
    trim: Callable[[], Awaitable[None]],
    poll_s: float,
) -> None:
    """`poll` every `poll_s` and `trim` every TRIM_EVERY_S, for good; a failure is said once
    per outage (`what`: the log, for the lines)."""
    trimmed = time.monotonic()
    failing = False
    while True:
        await asyncio.sleep(poll_s)
        try:
            await poll()
            if time.monotonic() - trimmed > TRIM_EVERY_S:
                trimmed = time.monotonic()
                await trim()
        except CacheStoreError as exc:
            # While Milvus is unreachable the log's freshness bound does not hold.
            if not failing:
                log.warning(f"reading {what} failed", extra={"error": str(exc)})
            failing = True
            continue
        if failing:
            log.info(f"reading {what} again")
        failing = False
