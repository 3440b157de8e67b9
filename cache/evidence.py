"""Where verified-hit evidence is kept, so that decisions survive a restart.

Two stores behind one interface (`EvidenceStore`):
- `EvidenceLog`, a SQLite file beside a milvus-lite file: one process, one file.
- `SharedEvidence` (cache/shared_evidence.py), a collection of the Milvus server the cache's
  replicas share: every replica appends its observations there, replays the store at
  start-up and follows its peers' observations, so replicas learn one rule together and a
  pod replaced in a rollout starts from what they learnt.

Each also hands out the keys that sign verify ids (cache/verify_ids.py).
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from hopline.cache.private_files import keep_private, private_folder
from hopline.cache.store import CacheSettingError
from hopline.cache.verify import SCOPE_WINDOW, Observation
from hopline.cache.verify_ids import key_due, keys_retired

KEY_BYTES = 32


class Noted(NamedTuple):
    """One observation as stored: `nonce` of the verify id it answered ('' if not kept)."""

    nonce: str
    scope: str  # verify.scope_key
    region: str
    obs: Observation


class EvidenceStore(Protocol):
    """Calls block; the verifier makes them from one thread, off the event loop."""

    set_aside: Path | None  # where an unusable earlier store was moved (SQLite only)
    unreadable: str | None  # why it was unusable

    def keys(self) -> list[bytes]:
        """The keys verify ids may be signed with, oldest first (the newest signs), rotated
        when a new one is due and the retired ones gone (cache/verify_ids.py:KEY_ROTATE_S)."""
        ...

    def append(self, rows: Sequence[Noted]) -> None: ...

    def replay(self) -> list[Noted]:
        """Each scope's latest SCOPE_WINDOW observations per stratum, oldest first."""
        ...

    def poll(self) -> list[Noted]:
        """Observations other replicas appended since the last poll, oldest first."""
        ...

    def trim(self, cutoffs: dict[tuple[str, str], float]) -> None:
        """Drop each (scope, stratum)'s observations made before its cutoff: they have left
        every replica's window."""
        ...

    def forget(self, scopes: Sequence[str]) -> None:
        """Drop what is kept of scopes this process forgot (cache/verify.py:Rules), where no
        other process reads it."""
        ...

    def close(self) -> None: ...


# The observations table as this code writes it; SQLite's user_version carries the number.
# Change both together: an older file is set aside at start-up (EvidenceLog.open_schema).
SCHEMA_VERSION = 2
COLUMNS = (
    ("scope", "TEXT"),
    ("region", "TEXT"),
    ("similarity", "REAL"),
    ("agreed", "INTEGER"),
    ("weight", "REAL"),
    ("region_ok", "INTEGER"),
    ("stratum", "TEXT"),
    ("at", "REAL"),
)


class EvidenceLog:
    """Observations appended to a SQLite file, replayed at start-up (decisions survive a
    restart). One writer thread's connection; Milvus stays the store of entries."""

    def __init__(self, path: Path) -> None:
        private_folder(path.parent)
        self.path = path
        self.set_aside: Path | None = None  # where a file of another schema was moved
        self.unreadable: str | None = None  # why SQLite could not read the file set aside
        self._lock = threading.Lock()
        # (made at, key), oldest first: this process's own keys (`keys`).
        self._keys: list[tuple[float, bytes]] = []
        try:
            self._db = self.open_schema(path)
        except sqlite3.DatabaseError as exc:
            self._db = self._begin_again(exc, None)

    def open_schema(self, path: Path) -> sqlite3.Connection:
        """The file at `path` with this code's schema. A file written by another version of
        the schema is moved aside (`<name>.v<version>`, never deleted) and a new one begun:
        evidence is what verification has learnt, so starting over only verifies more until
        it is learnt again, while reading columns that mean something else would misjudge."""
        if others := self._foreign_tables(path):
            # Another program's database (the milvus-lite file itself, named by mistake): our
            # table written into it beside a running server's own, never set aside.
            raise CacheSettingError(
                f"HOPLINE_CACHE_VERIFY_STATE {path} is another SQLite database (tables "
                f"{', '.join(others[:5])}): name a file of its own (default: beside the "
                "milvus-lite file, <name>.verify.sqlite)"
            )
        db = self._connect(path)
        found = self._schema(db)
        if found not in (None, SCHEMA_VERSION):
            db.close()
            self.set_aside = path.with_name(f"{path.name}.v{found}")
            for suffix in ("", "-wal", "-shm"):
                old = Path(f"{path}{suffix}")
                if old.exists():
                    old.replace(f"{self.set_aside}{suffix}")
            db = self._connect(path)
        columns = ", ".join(f"{name} {kind} NOT NULL" for name, kind in COLUMNS)
        db.execute(f"CREATE TABLE IF NOT EXISTS observations ({columns})")
        db.execute("CREATE INDEX IF NOT EXISTS by_scope ON observations (scope, at)")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return db

    def _begin_again(
        self, exc: sqlite3.DatabaseError, db: sqlite3.Connection | None
    ) -> sqlite3.Connection:
        """A file SQLite cannot read (not a database, a damaged page: a disk fault, a copy
        cut short) is moved aside (`<name>.unreadable-<UTC time>`, never deleted) and a new
        one begun, as for another schema: the cache serves on, verifying more until it has
        learnt again, rather than failing every start. A file it cannot open or write at all
        (a missing directory's permissions, a read-only disk) is the operator's to fix, said
        with the setting's name."""
        if isinstance(exc, sqlite3.OperationalError):
            raise RuntimeError(f"HOPLINE_CACHE_VERIFY_STATE {self.path}: {exc}") from exc
        if db is not None:
            db.close()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.set_aside = self.path.with_name(f"{self.path.name}.unreadable-{stamp}")
        self.unreadable = str(exc)
        for suffix in ("", "-wal", "-shm"):
            old = Path(f"{self.path}{suffix}")
            if old.exists():
                old.replace(f"{self.set_aside}{suffix}")
        return self.open_schema(self.path)

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        for suffix in ("", "-wal", "-shm"):  # SQLite gives its journal files the file's mode
            keep_private(Path(f"{path}{suffix}"))
        return db

    @staticmethod
    def _foreign_tables(path: Path) -> list[str]:
        """Tables no schema of this file ever had, read without changing the file (switching
        it to WAL, as `_connect` does, rewrites its header; a read may make its -wal and -shm
        files)."""
        if not path.is_file() or path.stat().st_size == 0:
            return []
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        finally:
            db.close()
        return sorted(name for (name,) in rows if name != "observations")

    @staticmethod
    def _schema(db: sqlite3.Connection) -> int | None:
        """The file's schema version; None for a new file. A file from before versions
        were numbered (user_version 0) counts as this version when its columns are these."""
        (version,) = db.execute("PRAGMA user_version").fetchone()
        if version:
            return int(version)
        table = db.execute("PRAGMA table_info(observations)").fetchall()
        if not table:
            return None
        # rows are (cid, name, type, notnull, default, pk)
        same = tuple((row[1], row[2]) for row in table) == COLUMNS
        return SCHEMA_VERSION if same else 1

    def keys(self, now: float | None = None) -> list[bytes]:
        """Keys of this process's own, rotated and retired as a shared store's are
        (cache/verify_ids.py:KEY_ROTATE_S): one process takes its ids, and an id from before
        a restart is refused (NOT_FOUND), as its comparison was never kept."""
        now = time.time() if now is None else now
        with self._lock:
            if key_due([made for made, _ in self._keys], now):
                self._keys.append((now, secrets.token_bytes(KEY_BYTES)))
            retired = set(keys_retired([made for made, _ in self._keys], now))
            self._keys = [k for i, k in enumerate(self._keys) if i not in retired]
            return [key for _, key in self._keys]

    def append(self, rows: Sequence[Noted]) -> None:
        now = time.time()
        with self._lock:
            self._db.executemany(
                "INSERT INTO observations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        s,
                        r,
                        o.similarity,
                        int(o.agreed),
                        o.weight,
                        int(o.region_ok),
                        o.stratum,
                        o.at or now,
                    )
                    for _, s, r, o in rows
                ],
            )

    def replay(self) -> list[Noted]:
        """Every scope's latest SCOPE_WINDOW observations per stratum, oldest first."""
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT scope, region, similarity, agreed, weight, region_ok, stratum, at"
                    " FROM ("
                    " SELECT *, rowid AS seq, ROW_NUMBER() OVER"
                    " (PARTITION BY scope, stratum ORDER BY rowid DESC) AS newest"
                    " FROM observations) WHERE newest <= ? ORDER BY seq",
                    (SCOPE_WINDOW,),
                ).fetchall()
            except sqlite3.DatabaseError as exc:  # a damaged page the header did not show
                self._db = self._begin_again(exc, self._db)
                return []
        # As judged when they were made: the region rule of that moment is not rebuilt.
        return [
            Noted("", scope, region, Observation(sim, bool(agreed), w, bool(ok), stratum, at))
            for scope, region, sim, agreed, w, ok, stratum, at in rows
        ]

    def poll(self) -> list[Noted]:
        return []  # one process writes the file

    def trim(self, cutoffs: dict[tuple[str, str], float]) -> None:
        """The observations that have left their window: the replay reads only the windows,
        and a file kept whole grew with every comparison for good."""
        with self._lock:
            self._db.executemany(
                "DELETE FROM observations WHERE scope = ? AND stratum = ? AND at < ?",
                [(scope, stratum, cutoff) for (scope, stratum), cutoff in cutoffs.items()],
            )

    def forget(self, scopes: Sequence[str]) -> None:
        with self._lock:
            self._db.executemany(
                "DELETE FROM observations WHERE scope = ?", [(scope,) for scope in scopes]
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()
