"""Embedded milvus-lite: what opening a database file involves besides pymilvus's client.

pymilvus starts milvus-lite's server (a child process on a Unix socket) when it is given a
file path. This module checks the file before that, sends the server's logs beside it, says
why a start failed, notices when the server has exited (`ServerExited`: the store then starts
it again, cache/milvus_connection.py) and stops the server when the store closes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hopline.cache.private_files import FILE_MODE, private_folder
from hopline.runtime import grpc_io

log = logging.getLogger("hopline.cache.milvus_lite")

# Starting milvus-lite's server is a process start, not a call, so it is not bound by the
# per-call timeout (HOPLINE_CACHE_MILVUS_TIMEOUT_S, 5 s by default): on an idle 2-core
# machine the socket answers 0.6 s after the start (1.6 s with the page cache dropped).
START_TIMEOUT_S = 30.0
START_POLL_S = 0.05  # between connection attempts while the server starts
EXIT_CHECK_S = 1.0  # how often the calls look whether the server is still running

_SQLITE_HEADER = b"SQLite format 3\x00"  # milvus-lite keeps its data in SQLite
# milvus-lite answers a write its SQLite refused for want of space with gRPC's "Unexpected
# error in RPC handling" (the reason, "database or disk is full", is only in its own log), so a
# failed write says the space left when it is below this: far more than a write needs. Below
# it nothing is written (cache/milvus_store.py:MilvusStore.upsert): on a full disk milvus-lite
# answered most inserts as written and kept none.
LOW_DISK_BYTES = 64 << 20
_GLOG_DIR = "GLOG_log_dir"  # glog's spelling, not upper case


class NotADatabase(ValueError):
    """The path exists but is not a milvus-lite database."""


class StartFailed(RuntimeError):
    """milvus-lite's server for a database file did not come up; the message says why."""


def is_local(uri: str) -> bool:
    return "://" not in uri


def check_database_file(path: Path) -> None:
    """Refuse to hand milvus-lite a path that is not its database (it would fail obscurely)."""
    if not path.exists():
        return
    if not path.is_file():
        raise NotADatabase(f"{path} is not a milvus-lite database file")
    if path.stat().st_size == 0:
        return  # a new database (SQLite's reading too): a start that failed on a full disk left it
    with path.open("rb") as f:
        header = f.read(len(_SQLITE_HEADER))
    if header != _SQLITE_HEADER:
        raise NotADatabase(
            f"{path} is not a milvus-lite database (no SQLite header): it is "
            "damaged or another kind of file; move it away to start an empty cache"
        )


@contextlib.contextmanager
def server_environment(db: Path) -> Iterator[None]:
    """The environment milvus-lite's server starts with while this is open: pymilvus starts
    it as a child with this process's environment.

    - Its logs go beside the database file (`logs_beside`).
    - gRPC's experiments are the operator's own GRPC_EXPERIMENTS. hopline's additions
      (runtime/grpc_io.py) are for the grpcio this process loaded; the server carries an older
      gRPC core that does not know `event_engine_listener` and logged "Unknown experiment"
      as an error at every start. This process's gRPC read the variable when it loaded, so
      only the child sees the change; the variable is put back afterwards for any process
      started later.
    """
    logs_beside(db)
    ours = os.environ.get(grpc_io.GRPC_ENV)
    _set_or_unset(grpc_io.GRPC_ENV, grpc_io.operators_experiments(os.environ) or None)
    try:
        yield
    finally:
        _set_or_unset(grpc_io.GRPC_ENV, ours)


def _set_or_unset(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def connect(
    pymilvus: Any, uri: str, timeout_s: float, start_timeout_s: float = START_TIMEOUT_S
) -> Any:
    """A `MilvusClient` on the database file `uri`, its server started if none runs yet.

    milvus-lite gives its server 0.5 s, then pymilvus fails at once if the socket is not
    there yet: on a loaded machine the server binds later (CI: a cache start, and once a
    test's own client, failed so). The server keeps starting, so the client is asked again
    until `start_timeout_s` ends; then the server is stopped and `StartFailed` says why.
    Call only once the path is known to be a database's (`check_database_file`).
    """
    path = Path(uri)
    took = hold(path)
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            with server_environment(path):
                return pymilvus.MilvusClient(uri, timeout=timeout_s)
        except Exception as exc:  # pymilvus raises many kinds here
            if starting(path) and time.monotonic() < deadline:
                time.sleep(START_POLL_S)
                continue
            reason = " ".join(str(getattr(exc, "message", None) or exc).split())[:300]
            hint = start_failure(path, reason, start_timeout_s)
            # A restart that failed keeps the hold this process had: its store tries again.
            stop_server(path, keep_hold=not took)
            raise StartFailed(f"{hint} ({reason})") from exc


# This process's holds on database files: resolved path -> the lock file's descriptor.
_HOLDS: dict[str, int] = {}


def hold_path(db: Path) -> Path:
    return db.absolute().parent / f".{db.name}.hopline.lock"


def hold(db: Path) -> bool:
    """Takes this process's hold on `db` before milvus-lite starts a server for it, kept until
    `stop_server`; whether it was taken now (False: held already).

    milvus-lite's own lock file is not enough: a start it refuses because another process
    holds the lock removes that file all the same on its way out (`Server.__del__` unlinks the
    path it never locked), so the next start made a new file, locked it and served the
    database beside the process still writing it (a durability probe: a second cache refused,
    a third SERVING on the same file). This file is never removed, and flock's lock ends with
    the process that holds it, a kill -9 included.
    """
    key = str(db.absolute().resolve())
    if key in _HOLDS:
        return False
    lock = hold_path(db)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        raise StartFailed(
            f"cannot make its lock file {lock} ({exc.strerror}): the folder holding the "
            "database file must be writable"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if isinstance(exc, BlockingIOError):
            raise StartFailed(
                f"another process holds it ({holder}milvus-lite allows one process per "
                "database file: is a second cache service running?)"
            ) from None
        raise StartFailed(f"cannot lock {lock} ({exc.strerror})") from exc
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HOLDS[key] = fd
    return True


def _holder(fd: int) -> str:
    """The holder's pid as "process N; ", read from the lock file it wrote it into."""
    with contextlib.suppress(OSError, ValueError):
        return f"process {int(os.pread(fd, 32, 0).decode().strip())}; "
    return ""


def release(db: Path) -> None:
    """Ends this process's hold on `db` (`hold`), if it has one."""
    fd = _HOLDS.pop(str(db.absolute().resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor ends its flock


def disk_note(db: Path) -> str:
    """For a failed write's message: how little space the disk holding `db` has left, when
    it is below LOW_DISK_BYTES; else nothing."""
    try:
        free = shutil.disk_usage(db.resolve().parent).free
    except OSError:
        return ""
    if free >= LOW_DISK_BYTES:
        return ""
    return (
        f" (the disk holding {db} has {free >> 10} KiB free: probably full; free space there "
        "or point HOPLINE_CACHE_URI at a larger disk)"
    )


def logs_beside(db: Path) -> None:
    """milvus-lite's server logs through glog, which writes a file into /tmp at every start
    unless told a folder: each cache start left one there. Its logs go beside the database
    file instead, unless the operator set GLOG_log_dir (`start_failure` names the folder they
    went to)."""
    logs = db.resolve().parent / f"{db.name}.logs"
    private_folder(logs)
    os.environ.setdefault(_GLOG_DIR, str(logs))


class _NoSessionTimestamp(logging.Filter):
    """Drops pymilvus's "failed to get mvccTs from milvus server" warning.

    milvus-lite 2.5.1 answers a query iterator's first call without a session timestamp, so
    pymilvus 2.5 warned at every iterator the cache opened (the start-up rebuild of the exact
    index, every paged scan) and read at the client's clock instead, which over one writer's
    file reads every row written before it. A server that sends none still warns: the filter
    goes on only where milvus-lite is opened, the one store of a cache process."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed to get mvccTs")


_ITERATOR_LOGGER = "pymilvus.client.iterator.query_iterator"


def quiet_iterator_timestamps() -> None:
    """Installs `_NoSessionTimestamp` on pymilvus's query-iterator logger (once)."""
    logger = logging.getLogger(_ITERATOR_LOGGER)
    if not any(isinstance(f, _NoSessionTimestamp) for f in logger.filters):
        logger.addFilter(_NoSessionTimestamp())


def start_failure(db: Path, reason: str, waited_s: float) -> str:
    """Why opening `db` failed, for the operator: call before `stop_server`."""
    if "Open local milvus failed" in reason:
        # milvus-lite's own start check: its server exited within 0.5 s or the lock is held.
        # On a full disk too, which it says only in its own log: the first cause to look at
        # there, before one that invites deleting a healthy file (a resource-exhaustion probe).
        if disk := disk_note(db):
            return f"milvus-lite's server could not open it{disk}"
        return (
            "another process holds it (milvus-lite allows one process per database file: "
            "is a second cache service running?) or it is damaged"
        )
    logs = os.environ.get(_GLOG_DIR, "/tmp")
    process = _server_process(db)
    if process is None:
        return f"milvus-lite's server is not running (its logs: {logs})"
    code = process.poll()
    if code is None:
        return f"milvus-lite's server did not answer within {waited_s:g}s (its logs: {logs})"
    return f"milvus-lite's server exited with code {code} while starting (its logs: {logs})"


def starting(db: Path) -> bool:
    """milvus-lite started a server for `db` and it is still running."""
    process = _server_process(db)
    return process is not None and process.poll() is None


def _registered(db: Path) -> Any:
    """milvus-lite's server object for `db`, if it started one. milvus-lite (pinned at 2.5.1)
    keeps its servers in a registry only, by resolved path: this reads its private fields."""
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return None
    return getattr(server_manager_instance, "_servers", {}).get(str(db.absolute().resolve()))


def _server_process(db: Path) -> subprocess.Popen[bytes] | None:
    """The server process milvus-lite started for `db`, if any."""
    process = getattr(_registered(db), "_p", None)
    return process if isinstance(process, subprocess.Popen) else None


class ServerExited:
    """Whether the server milvus-lite started for `db` has exited since the last look (or
    none is registered: a start that failed), looked at no more often than every `every_s`.
    Its exit is logged once, with its code."""

    def __init__(self, db: Path, every_s: float = EXIT_CHECK_S) -> None:
        self.db = db
        self.every_s = every_s
        self._next_look = time.monotonic() + every_s

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + self.every_s
        process = _server_process(self.db)
        code = None if process is None else process.poll()
        if process is not None and code is None:
            return False
        log.warning(
            "milvus-lite's server is not running; starting it again",
            extra={"db": str(self.db), "exit_code": code, "logs": os.environ.get(_GLOG_DIR)},
        )
        return True


def stop_server(db: Path, keep_hold: bool = False) -> None:
    """Stop the milvus-lite server process that opening `db` started: it is sent SIGTERM, then
    milvus-lite releases its lock and removes its socket. milvus-lite does that only at
    interpreter teardown, which a service's exit skips (runtime/server.py:_end_process), and
    not at all after a failed open.

    milvus-lite's own stop only releases the lock the server watches and gives it 2 s before
    SIGKILL, and the server did not always look in time: a store opened and closed on its own
    (tests, bench/scripts/write_cost.py) took 2.0 s to close, the server killed, where it
    exited by itself 4.5-5.0 s after the release (the cache service's own stop was already
    quick: 0.28 s from draining to stopped; why its server looked sooner was not found). What
    the server has acknowledged is in its SQLite file already: 2,000 rows inserted and 100
    deleted just before the stop were all read back after SIGTERM, SIGINT, SIGKILL or its own
    exit alike. So it is not waited for.

    This process's hold on the file (`hold`) ends too, unless `keep_hold`: a server that
    exited is started again on the file this process still owns."""
    process = _server_process(db)
    if process is not None and process.poll() is None:
        process.terminate()
    if _registered(db) is not None:
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(str(db))
    if not keep_hold:
        release(db)
