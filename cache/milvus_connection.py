"""One pymilvus client to Milvus, dialled again when what it was dialled with goes stale.

Over a Milvus server, that is its credentials' files. Milvus checks the token on every call,
so a password an operator rotates on the server fails every call made with the old one until
the cache presents the new one; a renewed TLS certificate is read only when a channel is
made. The files (cache/milvus_access.py) are watched (inode, size and mtime, compared at most
every `recheck_s`, from the calls that use the client, as the gateway watches its API keys):
once they change, a new client is dialled with what they hold now.

Over a milvus-lite file, it is the server process milvus-lite started for the file
(cache/milvus_lite.py:ServerExited): one killed (the kernel's OOM killer, a crash) left every
call failing until the cache restarted, since pymilvus reconnects to the dead server's socket.
Once it has exited, the next call starts it again on the same file (writes that failed
meanwhile are still pending and are retried: cache/writer.py).

Later calls use the new client; calls already on their way finish on the old one, closed
`grace_s` later. A dial that fails (files that cannot be used, half written, emptied or
removed; a server that refuses them; a milvus-lite server that does not start) leaves the
client in use as it is, with one warning, and is tried again at the next change (for
milvus-lite: at the next look, every `recheck_s`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from hopline.cache.milvus_access import MilvusAccess
from hopline.cache.store import CacheStoreError
from hopline.runtime.file_watch import FileWatch

log = logging.getLogger("hopline.cache.milvus_connection")

RECHECK_S = 2.0  # how often the credentials' files are compared with those dialled with
# How long an old client stays open after its replacement: longer than any call on it,
# a page-by-page scan of a large collection included (the index's rebuild).
GRACE_S = 300.0

Dial = Callable[[MilvusAccess], Any]  # a connected pymilvus.MilvusClient for this access


class Staleness(Protocol):
    """Whether the client should be dialled again (looked at from every call: cheap)."""

    def changed(self) -> bool: ...


class MilvusConnection:
    """The client in use (`client`), thread-safe: the cache calls Milvus from worker threads."""

    def __init__(
        self,
        dial: Dial,
        access: MilvusAccess,
        *,
        stale: Staleness | None = None,
        what: str = "Milvus credentials changed",
        grace_s: float = GRACE_S,
        recheck_s: float = RECHECK_S,
        describe: Callable[[BaseException], str] = str,
    ) -> None:
        """`dial` raises where the server cannot be reached or refuses the access; the first
        dial's error is the caller's. `stale`: when to dial again (default: once `access`'s
        files change); `what` says so in the log. `describe` words a later dial's error."""
        self._dial = dial
        self._describe = describe
        self.access = access
        self._client: Any = dial(access)
        if stale is None and access.files:
            stale = FileWatch(access.files, recheck_s)
        self._stale = stale
        self._what = what
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._closing: list[tuple[threading.Timer, Any]] = []  # old clients, closed later
        self.redials = 0  # clients dialled after the first

    @property
    def client(self) -> Any:
        """The client to call now (None once closed)."""
        if self._stale is not None and self._client is not None:
            with self._lock:
                if self._client is not None and self._stale.changed():
                    self._redial()
        return self._client

    def _redial(self) -> None:
        try:
            access = self.access.reread()
            client = self._dial(access)
        except Exception as exc:  # pymilvus raises many kinds; CacheStoreError for a file
            reason = str(exc) if isinstance(exc, CacheStoreError) else self._describe(exc)
            log.warning(
                f"{self._what}, but dialling again failed; calls go on with the client in use",
                extra={"reason": reason},
            )
            return
        old, self._client, self.access = self._client, client, access
        self.redials += 1
        log.info(f"{self._what}: dialled again")
        timer = threading.Timer(self._grace_s, _close, (old,))
        timer.daemon = True
        timer.start()
        self._closing = [(t, c) for t, c in self._closing if t.is_alive()] + [(timer, old)]

    def close(self) -> None:
        """Closes the client in use and any old one still waiting for its calls."""
        with self._lock:
            client, self._client = self._client, None
            closing, self._closing = self._closing, []
        for timer, old in closing:
            timer.cancel()
            _close(old)
        if client is not None:
            _close(client)


def _close(client: Any) -> None:
    try:
        client.close()
    except Exception:  # closing a broken client must not mask anything
        log.debug("closing a Milvus client failed", exc_info=True)
