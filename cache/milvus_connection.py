"""One pymilvus client to a Milvus server, dialled again when its credentials' files change.

Milvus checks the token on every call, so a password an operator rotates on the server fails
every call made with the old one until the cache presents the new one; a renewed TLS
certificate is read only when a channel is made. The files (cache/milvus_access.py) are
watched (inode, size and mtime, compared at most every `recheck_s`, from the calls that use
the client, as the gateway watches its API keys): once they change, a new client is dialled
with what they hold now and later calls use it. Calls already on their way finish on the old
client, closed `grace_s` later. Files that cannot be used (half written, emptied, removed), or
a dial the server refuses, leave the client in use as it is, with one warning a change: a
token written in two steps is taken up at the second.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from hopline.cache.milvus_access import MilvusAccess
from hopline.cache.store import CacheStoreError
from hopline.runtime.file_watch import FileWatch

log = logging.getLogger("hopline.cache.milvus_connection")

RECHECK_S = 2.0  # how often the credentials' files are compared with those dialled with
# How long an old client stays open after its replacement: longer than any call on it,
# a page-by-page scan of a large collection included (the index's rebuild).
GRACE_S = 300.0

Dial = Callable[[MilvusAccess], Any]  # a connected pymilvus.MilvusClient for this access


class MilvusConnection:
    """The client in use (`client`), thread-safe: the cache calls Milvus from worker threads."""

    def __init__(
        self,
        dial: Dial,
        access: MilvusAccess,
        *,
        grace_s: float = GRACE_S,
        recheck_s: float = RECHECK_S,
        describe: Callable[[BaseException], str] = str,
    ) -> None:
        """`dial` raises where the server cannot be reached or refuses the access; the first
        dial's error is the caller's. `describe` words a later dial's error for the log."""
        self._dial = dial
        self._describe = describe
        self.access = access
        self._client: Any = dial(access)
        self._watch = FileWatch(access.files, recheck_s) if access.files else None
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._closing: list[tuple[threading.Timer, Any]] = []  # old clients, closed later
        self.redials = 0  # clients dialled after the first

    @property
    def client(self) -> Any:
        """The client to call now (None once closed)."""
        if self._watch is not None and self._client is not None:
            with self._lock:
                if self._watch.changed():
                    self._redial()
        return self._client

    def _redial(self) -> None:
        try:
            access = self.access.reread()
            client = self._dial(access)
        except Exception as exc:  # pymilvus raises many kinds; CacheStoreError for a file
            reason = str(exc) if isinstance(exc, CacheStoreError) else self._describe(exc)
            log.warning(
                "Milvus credentials changed but cannot be used; calls go on with the ones in use",
                extra={"reason": reason},
            )
            return
        old, self._client, self.access = self._client, client, access
        self.redials += 1
        log.info("Milvus credentials changed: dialled again with them")
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
