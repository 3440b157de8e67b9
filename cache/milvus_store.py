"""MilvusStore: the cache's entries in one Milvus collection per embedding model.

A file path runs embedded milvus-lite, an http(s) URI a Milvus standalone or cluster. Calls
block (pymilvus is synchronous); the servicer runs them on its own threads. What a row holds
is cache/milvus_rows.py's; the generations a milvus-lite reclaim copies into,
cache/generations.py's.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from hopline.cache import milvus_lite as lite
from hopline.cache.config import MILVUS_DB_ENV
from hopline.cache.generations import (
    CATCH_UP_ROUNDS,
    HELD_REPLAY_MAX,
    Gate,
    Reclaimed,
    Write,
    current_and_abandoned,
    generation_name,
    generation_of,
)
from hopline.cache.keys import scope_digest
from hopline.cache.milvus_access import NO_ACCESS, MilvusAccess, uri_problem
from hopline.cache.milvus_connection import MilvusConnection
from hopline.cache.milvus_index import IndexNotBuilt, build_index, create_indexed
from hopline.cache.milvus_lite import is_local
from hopline.cache.milvus_rows import (
    MAX_TEXT_BYTES,
    SCALARS,
    SCOPE_NAME_MAX,
    deleted_count,
    entry_id,
    from_hit,
    from_row,
    id_ranges,
    to_columns,
    to_row,
)
from hopline.cache.private_files import keep_private, private_folder
from hopline.cache.store import (
    LIVE_PAGE,
    LOAD_TIMEOUT_S,
    CacheSettingError,
    CacheStoreError,
    Entry,
    LookupConsistency,
    Scope,
    ScopeFilter,
    Vector,
)

log = logging.getLogger("hopline.cache.milvus_store")

# Reads off the request path see every acknowledged write: eviction must count what is really
# there, a store must know which keys exist. Lookups choose (LookupConsistency).
CONSISTENCY = "Strong"
RECLAIM_MIN_DEAD = 1000  # below this many deleted rows a reclaim is not worth its copy
# Rows per page of the scan for a scope's oldest (two short fields a row): on 94,500 rows in
# milvus-lite 1.0-1.1 s in pages of 2,000, 0.36-0.38 s in pages of 16,000.
AGES_PAGE = 16_000
# Rows per page of a read that carries vectors: a scope's read-back (`vectors_of`) and the
# reclaim's copy (peak memory of a 20k-row copy: +100 MB). Unlike scalar fields, such pages
# cost milvus-lite more past about 1,000 rows: over 200,000 rows the read-back took 24.7-25.0 s
# in pages of 500, 26.6 in 1,000, 35.7-37.2 in 2,000 (what it had), 29.8-35.3 in 250; a page of
# 16,384 passed the 5 s call bound, and the copy took 133 s in pages of 4,000 against 58.
VECTORS_PAGE = 500
LIVE_READERS = 2  # the exact index's rebuild reads this many id ranges at once (`live`)
T = TypeVar("T")


def quiet_pymilvus() -> Any:
    # milvus-lite 2.5 imports pkg_resources, which warns on import; the warning is about
    # milvus-lite's packaging, not about anything hopline can act on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        import pymilvus

        with contextlib.suppress(ImportError):
            import milvus_lite  # noqa: F401
    return pymilvus


# Milvus's error code for a database that does not exist (HOPLINE_CACHE_MILVUS_DB).
DATABASE_NOT_FOUND = 800


def milvus_reason(exc: BaseException) -> str:
    """What pymilvus or gRPC said, on one line and at most 300 characters; a refused
    privilege with what grants it, a missing database with what makes it."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        message = f"{exc.code().name}: {exc.details()}"
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            message += " (the cache's Milvus user lacks it: `hopline cache milvus-user` grants "
            message += "what the cache needs)"
    else:
        message = getattr(exc, "message", None) or str(exc)
        if getattr(exc, "code", None) == DATABASE_NOT_FOUND:
            message = f"{message} ({MILVUS_DB_ENV}: `hopline cache milvus-user` makes it)"
    return " ".join(str(message).split())[:300]


class MilvusStore:
    def __init__(
        self,
        uri: str,
        collection: str,
        dim: int,
        *,
        index_type: str = "AUTOINDEX",
        timeout_s: float = 5.0,
        reclaim_ratio: float = 0.0,
        lookup_consistency: LookupConsistency = LookupConsistency.STRONG,
        start_timeout_s: float = lite.START_TIMEOUT_S,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        access: MilvusAccess = NO_ACCESS,
    ) -> None:
        # Before anything is made or dialled: the cache checks it at its start already
        # (MilvusAccess.of), the commands that open a store only here.
        if problem := uri_problem(uri):
            raise CacheSettingError(problem)
        self.uri = uri
        self.load_timeout_s = load_timeout_s
        self.access = access  # a Milvus server's token and TLS
        self.start_timeout_s = start_timeout_s  # milvus-lite's server start, by file only
        self.lookup_level = lookup_consistency.milvus_level
        self.base = collection
        self.collection = collection  # the generation in use (cache/generations.py)
        self.dim = dim
        self.timeout_s = timeout_s
        self.index_type = index_type
        # milvus-lite only: reclaim once deleted rows reach this many times the live ones.
        self.reclaim_ratio = reclaim_ratio
        self._gate = Gate()
        self._schemas: dict[str, dict[str, Any]] = {}  # by collection, for column inserts
        self._dead = 0  # rows deleted or replaced since this generation was opened
        self._dead_lock = threading.Lock()
        pymilvus = quiet_pymilvus()
        self._pymilvus = pymilvus
        # pymilvus logs to its own stderr handler; route it through the service's logs, and
        # only what is CRITICAL: it logged every failed call at ERROR with its traceback (ten
        # a second while a Milvus server was away: the shared invalidation log is read every
        # 100 ms), where each failure reaches the cache as the call's exception and is said
        # there with its reason (once an outage for those reads, once a retry for writes).
        pymilvus_log = logging.getLogger("pymilvus")
        pymilvus_log.handlers.clear()
        pymilvus_log.propagate = True
        pymilvus_log.setLevel(logging.CRITICAL)
        self._exc: type[Exception] = pymilvus.MilvusException
        self._connection: MilvusConnection | None = self._connect(pymilvus)
        try:
            self.collection = self._open_generation()
            if self._client.has_collection(self.collection, timeout=timeout_s):
                self._validate()
            else:
                self._create(self.collection)
            self._load()
        except CacheStoreError:
            self.close()
            raise
        except (self._exc, grpc.RpcError, IndexNotBuilt) as exc:
            self.close()
            raise CacheStoreError(f"Milvus at {uri}: {milvus_reason(exc)}") from exc

    def _load(self) -> None:
        """Loads the collection into Milvus's memory within `load_timeout_s`, not one call's
        bound: milvus-lite reads every row back from its file first, 9.5 s for 200,000 rows
        and 66 s for 1,000,000 on the 2-core VM, and with the 30 s a call's bound gave it, a
        cache past about 450,000 rows (under the default bound of 1,000,000) failed every
        start. What it waits for is logged first."""
        rows = self._rows_before_load()
        where = {"collection": self.collection, "uri": self.uri, "rows": rows}
        log.info("loading the cache collection", extra=where)
        started = time.perf_counter()
        try:
            self._client.load_collection(self.collection, timeout=self.load_timeout_s)
        except (self._exc, grpc.RpcError) as exc:
            if time.perf_counter() - started < self.load_timeout_s:
                raise
            what = self.collection if rows is None else f"the {rows} rows of {self.collection}"
            raise CacheStoreError(
                f"Milvus at {self.uri} did not load {what} within {self.load_timeout_s:g} s "
                "(HOPLINE_CACHE_LOAD_TIMEOUT_S): raise it, or lower HOPLINE_CACHE_MAX_ENTRIES "
                f"({milvus_reason(exc)})"
            ) from exc
        log.info(
            "cache collection loaded",
            extra={**where, "seconds": round(time.perf_counter() - started, 2)},
        )

    def _rows_before_load(self) -> int | None:
        """The collection's rows, for the load's log and message; None where the cache's
        Milvus user may not read a collection's statistics (`hopline cache milvus-user` grants
        only the privileges the cache's calls need, and users made before this call have not
        got it). milvus-lite has no users: there a count that fails is a damaged file
        (CacheStoreError), which milvus-lite loads all the same, and whose new entries were
        lost at the next start (a cache probe: random bytes over 300 of a file's pages, the
        cache SERVING with 25 of 1,614 entries, 30 stores acknowledged, 0 held)."""
        try:
            stats = self._client.get_collection_stats(self.collection, timeout=self.timeout_s)
        except (self._exc, grpc.RpcError) as exc:
            if is_local(self.uri):
                raise CacheStoreError(
                    f"Milvus at {self.uri} cannot count the rows of {self.collection}: the "
                    "file looks damaged (milvus-lite's own lines above may say 'database disk "
                    "image is malformed'); move it aside to start with an empty cache, or "
                    f"put back a copy ({milvus_reason(exc)})"
                ) from exc
            return None
        return int(stats.get("row_count", 0))

    def _connect(self, pymilvus: Any) -> MilvusConnection:
        if not is_local(self.uri):

            def dial(access: MilvusAccess) -> Any:
                return pymilvus.MilvusClient(
                    self.uri, timeout=self.timeout_s, dedicated=True, **access.client_kwargs()
                )

            try:
                return MilvusConnection(dial, self.access, describe=milvus_reason)
            except Exception as exc:  # pymilvus raises many kinds here
                # pymilvus says the same whether nothing answered or the server refused us:
                # whether anything listens there tells the two apart.
                hint = (
                    f"{_who_answered(self.uri, self.timeout_s)} (HOPLINE_CACHE_URI), "
                    + self.access.refusal_hint(self.uri)
                )
                raise CacheStoreError(
                    f"cannot open Milvus at {self.uri}: {hint} ({milvus_reason(exc)})"
                ) from exc
        path = Path(self.uri)
        private_folder(path.parent)
        try:
            lite.check_database_file(path)
        except lite.NotADatabase as exc:
            raise CacheStoreError(str(exc)) from exc
        lite.quiet_iterator_timestamps()

        def start(_: MilvusAccess) -> Any:
            if not lite.starting(path):  # one that exited: its registration and the lock
                lite.stop_server(path, keep_hold=True)
            return lite.connect(pymilvus, self.uri, self.timeout_s, self.start_timeout_s)

        try:
            connection = MilvusConnection(
                start,
                NO_ACCESS,
                stale=lite.ServerExited(path),
                what="milvus-lite's server exited",
                describe=milvus_reason,
            )
        except lite.StartFailed as exc:
            raise CacheStoreError(f"cannot open Milvus at {self.uri}: {exc}") from exc
        keep_private(path)  # made by milvus-lite's server with the umask's mode
        if disk := lite.disk_note(path):
            # Said at the start, not only at the first write: on a volume under the margin
            # (a probe's 20 MiB one) the cache went SERVING and wrote nothing, saying so only
            # once stores had queued.
            log.warning(
                "the milvus-lite file's disk is short of space: stores wait unwritten "
                "until it has more",
                extra={
                    "uri": self.uri,
                    "note": disk.strip(" ()"),
                    "needs_bytes": lite.LOW_DISK_BYTES,
                },
            )
        return connection

    @property
    def _client(self) -> Any:
        """The pymilvus client to call now (None once closed): a server's is dialled again
        when its credentials' files change (cache/milvus_connection.py)."""
        connection = self._connection
        return None if connection is None else connection.client

    def _open_generation(self) -> str:
        """The lowest generation present; copies above it are unfinished reclaims: dropped."""
        names = self._client.list_collections(timeout=self.timeout_s)
        current, abandoned = current_and_abandoned(self.base, names)
        for name in abandoned:
            log.warning(
                "dropping an unfinished reclaim copy", extra={"collection": name, "uri": self.uri}
            )
            self._client.drop_collection(name, timeout=self.timeout_s)
        return current

    def _create(self, collection: str) -> None:
        dt = self._pymilvus.DataType
        schema = self._pymilvus.MilvusClient.create_schema(
            auto_id=False, enable_dynamic_field=False
        )
        schema.add_field("id", dt.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("vector", dt.FLOAT_VECTOR, dim=self.dim)
        for name in ("scope_key", "tenant_key", "model_key", "version_key"):
            schema.add_field(name, dt.VARCHAR, max_length=64)
        for name in ("tenant", "model", "model_version"):
            schema.add_field(name, dt.VARCHAR, max_length=SCOPE_NAME_MAX)
        for name in ("params", "text", "response"):
            schema.add_field(name, dt.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("created_at", dt.DOUBLE)
        schema.add_field("expires_at", dt.DOUBLE)
        create_indexed(
            self._client,
            collection,
            schema=schema,
            index_params=self._index_params(),
            consistency_level=CONSISTENCY,
            timeout_s=self.timeout_s * 6,
        )
        log.info(
            "created cache collection",
            extra={"collection": collection, "uri": self.uri, "index": self.index_type},
        )

    def _index_params(self) -> Any:
        index = self._client.prepare_index_params()
        index.add_index(field_name="vector", index_type=self.index_type, metric_type="COSINE")
        return index

    def _validate(self) -> None:
        """Refuse a collection whose vectors cannot be compared with ours; index one that
        has none yet."""
        desc = self._client.describe_collection(self.collection, timeout=self.timeout_s)
        fields = {f["name"]: f for f in desc["fields"]}
        missing = [n for n in ("id", "vector", *SCALARS) if n not in fields]
        where = f"collection {self.collection!r} at {self.uri}"
        if missing:
            raise CacheStoreError(
                f"{where} lacks fields {missing}: it was not written by this hopline version; "
                "use another HOPLINE_CACHE_URI or drop the collection"
            )
        dim = int(fields["vector"].get("params", {}).get("dim", -1))
        if dim != self.dim:
            raise CacheStoreError(
                f"{where} holds {dim}-d vectors but the embedder makes {self.dim}-d ones; "
                "use another HOPLINE_CACHE_URI or drop the collection"
            )
        index = self._client.describe_index(self.collection, "vector", timeout=self.timeout_s)
        if not index:
            # Milvus makes a collection and its index in two steps: a start that stopped
            # between them (killed, its deadline passed, CreateIndex refused to its user)
            # leaves the collection unindexed, and no collection loads without an index.
            log.warning(
                "indexing a cache collection left without its index",
                extra={"collection": self.collection, "uri": self.uri},
            )
            build_index(self._client, self.collection, self._index_params(), self.timeout_s * 6)
            return
        metric = index.get("metric_type")
        if metric != "COSINE":
            raise CacheStoreError(f"{where} is indexed with metric {metric}; hopline needs COSINE")

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: str, now: float) -> Entry | None:
        rows = self._call(
            "query",
            filter=f'id == "{entry_id(key)}" and expires_at > {now!r}',
            output_fields=["id", *SCALARS],
            consistency_level=self.lookup_level,
        )
        return from_row(rows[0]) if rows else None

    def live(self, now: float, page: int = LIVE_PAGE) -> list[Entry]:
        """Every live entry's scalar fields (no vectors), in pages: the exact index's rebuild.

        Read as 16 id ranges, LIVE_READERS at a time: milvus-lite filters every row of the
        collection for each page it answers, and pymilvus turns a page into rows on the
        calling thread, so a lone reader left the server idle while it decoded and itself
        idle while the server filtered."""
        expression = f"expires_at > {now!r}"
        fields = ["id", *SCALARS]
        with ThreadPoolExecutor(LIVE_READERS, thread_name_prefix="cache-live") as readers:
            parts = readers.map(
                lambda ids: self._scan(f"{expression} and {ids}", fields, from_row, page),
                id_ranges(),
            )
            return [entry for part in parts for entry in part]

    def vectors_of(self, scope: Scope, now: float) -> list[tuple[str, Vector]]:
        return self._scan(
            f'scope_key == "{scope_digest(scope)}" and expires_at > {now!r}',
            ["id", "vector"],
            lambda row: (str(row["id"]), np.asarray(row["vector"], dtype=np.float32)),
            VECTORS_PAGE,
        )

    def _scan(
        self,
        expression: str,
        fields: list[str],
        each: Callable[[dict[str, Any]], T],
        page: int,
    ) -> list[T]:
        """`each` of every row matching `expression`, read in pages: a plain query returns at
        most 16,384 rows (Milvus's result window, milvus-lite's too), whatever it matches."""
        found: list[T] = []
        with self._gate.call():
            if self._client is None:
                raise CacheStoreError("the cache store is closed")
            try:
                pages = self._client.query_iterator(
                    self.collection,
                    batch_size=page,
                    filter=expression,
                    output_fields=fields,
                    consistency_level=CONSISTENCY,
                    timeout=self.timeout_s,
                )
                try:
                    while rows := pages.next():
                        found.extend(each(row) for row in rows)
                finally:
                    pages.close()
            except (self._exc, grpc.RpcError) as exc:
                raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}") from exc
        return found

    def search(
        self, vectors: Sequence[Vector], scope: Scope, now: float, limit: int
    ) -> list[list[tuple[Entry, float]]]:
        hits = self._call(
            "search",
            data=[v.astype(np.float32).tolist() for v in vectors],
            limit=limit,
            filter=f'scope_key == "{scope_digest(scope)}" and expires_at > {now!r}',
            output_fields=list(SCALARS),
            search_params={"metric_type": "COSINE"},
            consistency_level=self.lookup_level,
        )
        return [[from_hit(hit) for hit in per_query] for per_query in hits]

    def count(self, tenant: str = "", model: str = "") -> int:
        expression = ScopeFilter(tenant, model).expression()
        rows = self._call(
            "query",
            filter=expression,
            output_fields=["count(*)"],
            consistency_level=CONSISTENCY,
        )
        return int(rows[0]["count(*)"])

    def oldest(self, tenant: str, model: str, n: int) -> list[str]:
        expression = ScopeFilter(tenant, model).expression()
        ages = self._scan(
            expression, ["id", "created_at"], lambda r: (r["created_at"], r["id"]), AGES_PAGE
        )
        return [str(key) for _, key in heapq.nsmallest(n, ages)]

    # -- writes ---------------------------------------------------------------------------

    def upsert(self, rows: Sequence[tuple[Entry, Vector]]) -> None:
        """Insert new keys, replace existing ones.

        Most stores follow a miss, so their keys are new. milvus-lite 2.5.1 pays about 30 ms
        for any upsert (a delete by key, then an insert) against 3 ms for an insert, and
        searches stall behind it (bench: lookup p50 6.7 -> 30 ms with a store per lookup):
        one key query sorts the batch, and only keys already present take the upsert.
        Two cache replicas on one Milvus server racing to insert the same new key can leave
        a duplicate row; it holds the same scope, text and answer, and a delete by key or
        scope removes both.
        """
        if rows:
            columns = to_columns(rows)  # a row Milvus would refuse is refused here, whole
            if is_local(self.uri) and (disk := lite.disk_note(Path(self.uri))):
                # milvus-lite answers most inserts on a full disk as written and keeps none
                # of them (a probe: 2,048 of 2,420 acknowledged entries gone after a restart,
                # nothing said): not written until there is room. The writer keeps them
                # pending (cache/writer.py:HOST_SHORTAGES).
                raise CacheStoreError(f"Milvus at {self.uri}: not written{disk}")
            # A reclaim's journal keeps the replay, which makes its columns again: the vector
            # column is plain floats (about 12 KiB a row at 384 dimensions), the rows' own
            # vectors a shared placeholder or 1.5 KiB of float32.
            self._write(
                lambda name: self._upsert_into(name, rows, columns),
                lambda name: self._upsert_into(name, rows, to_columns(rows)),
                len(rows),
            )

    def _upsert_into(
        self,
        collection: str,
        rows: Sequence[tuple[Entry, Vector]],
        columns: dict[str, list[Any]],
    ) -> int:
        """Returns the rows replaced: each leaves a deleted row behind in milvus-lite."""
        present = self._client.query(
            collection,
            filter=f"id in {json.dumps(columns['id'])}",
            output_fields=["id"],
            consistency_level=CONSISTENCY,
            timeout=self.timeout_s,
        )
        existing = {str(r["id"]) for r in present}
        if not existing:
            self._insert_columns(collection, columns)
            return 0
        fresh = [i for i, key in enumerate(columns["id"]) if key not in existing]
        if fresh:
            self._insert_columns(
                collection, {name: [values[i] for i in fresh] for name, values in columns.items()}
            )
        known = [to_row(e, v) for e, v in rows if entry_id(e.key) in existing]
        self._client.upsert(collection, known, timeout=self.timeout_s)
        return len(known)

    def _insert_columns(self, collection: str, columns: dict[str, list[Any]]) -> None:
        """A column-based insert: what pymilvus's ORM `Collection.insert` sends, through the
        client's own connection (MilvusClient takes rows only, and packs each field of each
        row on its own). The schema is read once per collection (a reclaim's generation is
        another name). pymilvus is pinned below 3.1 for these two calls;
        tests/mesh/test_cache_store_scan.py reads every field of such rows back."""
        conn = self._client._get_connection()
        context = self._client._generate_call_context()
        schema = self._schemas.get(collection)
        if schema is None:
            schema = conn.describe_collection(collection, timeout=self.timeout_s, context=context)
            self._schemas[collection] = schema
        entities = [
            {"name": f["name"], "type": f["type"], "values": columns[f["name"]]}
            for f in schema["fields"]
        ]
        conn.batch_insert(
            collection, entities, timeout=self.timeout_s, context=context, schema=schema
        )

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        ids = [entry_id(k) for k in keys]
        return self._write(lambda name: self._delete_from(name, ids=ids), rows=len(ids))

    def delete_scope(self, scope: ScopeFilter) -> int:
        if scope.is_empty():
            raise ValueError("refusing to delete every tenant's entries")
        expression = scope.expression()
        return self._write(lambda name: self._delete_from(name, filter=expression))

    def expire(self, now: float) -> int:
        expression = f"expires_at <= {now!r}"
        return self._write(lambda name: self._delete_from(name, filter=expression))

    def _delete_from(self, collection: str, **which: Any) -> int:
        return deleted_count(self._client.delete(collection, timeout=self.timeout_s, **which))

    def _write(self, write: Write, replay: Write | None = None, rows: int = 1) -> int:
        """Applies `write` to the generation in use; during a reclaim, also records it (or
        `replay`, the same write made again from less memory) with the rows it carries."""
        with self._gate.call():
            if self._client is None:
                raise CacheStoreError("the cache store is closed")
            try:
                removed = write(self.collection)
            except (self._exc, grpc.RpcError) as exc:
                disk = lite.disk_note(Path(self.uri)) if is_local(self.uri) else ""
                raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}{disk}") from exc
            self._gate.record(replay or write, rows)
            with self._dead_lock:
                self._dead += removed
            return removed

    # -- reclaiming milvus-lite's memory (cache/generations.py) ---------------------------

    def stores_wait(self) -> bool:
        return self._gate.full()

    def reclaim(self, now: float) -> Reclaimed | None:
        """Copies the live rows to the next generation once the deleted rows milvus-lite still
        holds reach `reclaim_ratio` times the live ones (and RECLAIM_MIN_DEAD); None otherwise.

        Lookups and writes go on during the copy, against the old generation; the writes are
        recorded and applied to the copy, and only those of the last moment are applied while
        calls wait. A Milvus server compacts by itself: this is for milvus-lite only.
        """
        if not self.reclaim_ratio or not is_local(self.uri) or self._client is None:
            return None
        if self._dead < RECLAIM_MIN_DEAD or self._dead < self.reclaim_ratio * self.count():
            return None
        started = time.perf_counter()
        old = self.collection
        new = generation_name(self.base, (generation_of(self.base, old) or 0) + 1)
        freed = self._dead
        try:
            if self._client.has_collection(new, timeout=self.timeout_s):
                self._client.drop_collection(new, timeout=self.timeout_s)
            self._create(new)
            self._client.load_collection(new, timeout=self.timeout_s * 6)
            self._gate.open_journal()
            copied = self._copy_live(old, new, now)
            replayed = self._catch_up(new)
            with self._gate.held():
                switch_started = time.perf_counter()
                replayed += self._replay(self._gate.close_journal(), new)
                self._client.drop_collection(old, timeout=self.timeout_s)  # the commit
                self.collection = new
                with self._dead_lock:
                    self._dead = 0
                switch_ms = (time.perf_counter() - switch_started) * 1e3
        except (self._exc, grpc.RpcError, CacheStoreError, IndexNotBuilt) as exc:
            with self._gate.held():
                self._gate.close_journal()
            if self.collection == old and self._client is not None:
                with contextlib.suppress(Exception):  # the next open drops it anyway
                    self._client.drop_collection(new, timeout=self.timeout_s)
            raise CacheStoreError(f"reclaiming {old} at {self.uri}: {milvus_reason(exc)}") from exc
        return Reclaimed(new, copied, freed, replayed, time.perf_counter() - started, switch_ms)

    def _copy_live(self, source: str, target: str, now: float) -> int:
        fields = ("id", "vector", *SCALARS)
        pages = self._client.query_iterator(
            source,
            batch_size=VECTORS_PAGE,
            filter=f"expires_at > {now!r}",
            output_fields=list(fields),
            consistency_level=CONSISTENCY,
            timeout=self.timeout_s,
        )
        copied = 0
        try:
            while rows := pages.next():
                # By column, as upserts go: the client's row insert packs each field of each
                # row on its own, a quarter of the copy's time (docs/cache.md, reclaims).
                self._insert_columns(target, {f: [row[f] for row in rows] for f in fields})
                copied += len(rows)
        finally:
            pages.close()
        return copied

    def _catch_up(self, target: str) -> int:
        """Replays the recorded writes while calls go on, round after round while new ones
        keep arriving, so that the switch, which holds every call, has only a few left."""
        replayed = 0
        for _ in range(CATCH_UP_ROUNDS):
            writes = self._gate.take_journal()
            replayed += self._replay(writes, target)
            if len(writes) <= HELD_REPLAY_MAX:
                break
        return replayed

    def _replay(self, writes: list[Write], target: str) -> int:
        for write in writes:
            write(target)
        return len(writes)

    def close(self) -> None:
        connection, self._connection = getattr(self, "_connection", None), None
        if connection is not None:
            connection.close()
            if is_local(self.uri):
                lite.stop_server(Path(self.uri))

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The client's `method(<generation in use>, *args, ...)`; a reclaim's switch waits."""
        with self._gate.call():
            if self._client is None:
                raise CacheStoreError("the cache store is closed")
            try:
                fn = getattr(self._client, method)
                return fn(self.collection, *args, timeout=self.timeout_s, **kwargs)
            except (self._exc, grpc.RpcError) as exc:
                # A stalled server surfaces as a bare gRPC DEADLINE_EXCEEDED, not a
                # MilvusException.
                raise CacheStoreError(f"Milvus at {self.uri}: {milvus_reason(exc)}") from exc


DEFAULT_MILVUS_PORT = 19530  # pymilvus's, for a URI that names none


def _who_answered(uri: str, timeout_s: float) -> str:
    """What a TCP connection to a server URI's host and port finds, for a failed dial."""
    parts = urllib.parse.urlsplit(uri)
    try:
        port = parts.port or (443 if parts.scheme == "https" else DEFAULT_MILVUS_PORT)
    except ValueError:
        return "a port that is no number"
    if parts.scheme == "unix" or not parts.hostname:
        return f"no Milvus answered within {timeout_s:g}s"
    try:
        with socket.create_connection((parts.hostname, port), timeout=min(timeout_s, 2.0)):
            pass
    except OSError as exc:
        return f"nothing answers at {parts.hostname}:{port} ({exc.strerror or exc})"
    return (
        f"something listens at {parts.hostname}:{port} but did not answer as Milvus within "
        f"{timeout_s:g}s (another service, a TLS setting that does not match, or refused us)"
    )
