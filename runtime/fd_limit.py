"""File descriptors: every service raises its soft limit to the hard one at start, and says so
when it nears the limit it has.

A process out of file descriptors cannot accept a connection: gRPC retries its accept
quietly, callers wait out their deadlines, and the only line a gateway wrote was the model
list's re-read failing "Too many open files" every 10 s (a resource-exhaustion probe, `ulimit
-n` 64 to 256). Each caller's connection, each upstream channel, milvus-lite's files and
sockets take one or more; a container runtime's default soft limit (1,024) is reached by a
gateway with a few hundred clients. The hard limit is the operator's bound, the soft one only
a default: raised to the hard one, as Go's runtime does for every Go server since 1.19.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
from collections.abc import Callable

log = logging.getLogger("hopline.runtime.fds")

WATCH_EVERY_S = 5.0
NEAR = 0.8  # of the soft limit: said once, until below BACK
BACK = 0.7


def raise_soft_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the limit it has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # a sandbox that refuses it: the soft limit stands
        return soft
    return hard


def open_fds() -> int:
    """How many file descriptors this process has open (Linux's /proc)."""
    return len(os.listdir("/proc/self/fd"))


class FdWatch:
    """Says once when the open descriptors pass NEAR of the limit, and again once they are
    back below BACK. `count` and `limit` are given for tests."""

    def __init__(
        self,
        count: Callable[[], int] = open_fds,
        limit: Callable[[], int] = lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    ) -> None:
        self._count = count
        self._limit = limit
        self.near = False

    def check(self) -> None:
        limit = self._limit()
        if limit <= 0 or limit == resource.RLIM_INFINITY:
            return
        try:
            used = self._count()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                return  # no /proc here
            used = limit  # not one left to read /proc/self/fd with
        if not self.near and used >= NEAR * limit:
            self.near = True
            log.warning(
                "file descriptors nearly all in use: at the limit, new connections wait "
                "unanswered and files fail to open; raise the limit (`ulimit -n`, systemd's "
                "LimitNOFILE, the container runtime's nofile) or add replicas",
                extra={"open_fds": used, "limit": limit},
            )
        elif self.near and used < BACK * limit:
            self.near = False
            log.info("file descriptors back under the limit", extra={"open_fds": used})

    async def run(self, every_s: float = WATCH_EVERY_S) -> None:
        while True:
            self.check()
            await asyncio.sleep(every_s)
