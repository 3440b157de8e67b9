"""How current a cache replica's memory is with the other replicas' invalidations, where
replicas share a Milvus server (cache/shared_invalidations.py), and the two gaps the shared
log alone left open (a probe of two replicas and two gateways on one server, stop 100):

- *A write that lands after a peer's delete.* Replica A deletes an invalidated entry from
  Milvus, then logs the event; replica B hears of it at its next poll. A store B took before
  that (its fence did not know yet), or was writing while A deleted, landed after A's delete
  and stayed in Milvus: once the tombstones expired every replica served it again, EXACT and
  as a SEMANTIC neighbour, for its whole TTL (26 of 260 trials). So B keeps the keys it
  wrote until a poll that must have seen any delete made before them, and deletes again the
  ones a peer's event names (`landed`, `matching`; cache/invalidation.py:apply_peer).
- *A log that cannot be read.* While Milvus did not answer B's polls, B's exact index and
  its gateways' local exact tiers served entries A had invalidated for the whole outage.
  Memory is trusted only while the log was read within `stale_s` (`current`): past it,
  lookups read Milvus, watch streams end (every gateway drops its copy) and new ones are
  refused, until the log is read again. Where the gap outlived the log's own history
  (shared_invalidations.KEEP_S), memory is dropped: events may be gone unread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable

from hopline.cache.store import ScopeFilter
from hopline.cache.watch_feed import WatchFeed

log = logging.getLogger("hopline.cache.peer_sync")

Scope = tuple[str, str, str, str]  # Entry.scope

# Keys written and not yet covered by a poll: a write rate of 10,000 stores a second over a
# 15 s window (3 Milvus timeouts of 5 s) at about 150 bytes each, 22 MB. Past it the oldest
# go first, and only a peer's delete both older than them and unread for that long is missed.
LANDED_MAX = 150_000


class PeerSync:
    """One replica's view of its peers' log: when it was last read, and its recent writes."""

    def __init__(self, stale_s: float, margin_s: float, history_s: float) -> None:
        self.stale_s = stale_s  # memory answers only while the log was read this recently
        # The longest a peer's delete can precede its event in the log: a write that landed
        # this long before a poll began is covered by that poll.
        self.margin_s = margin_s
        self.history_s = history_s  # how far back the log keeps events
        self.read_at = time.monotonic()  # the start of the last poll that read the log
        self.watches_ended = False  # this outage's streams were ended (once per outage)
        self._landed: OrderedDict[str, tuple[float, Scope]] = OrderedDict()

    def current(self, now: float | None = None) -> bool:
        """Whether memory may answer: the peers' log was read within `stale_s`."""
        return (time.monotonic() if now is None else now) - self.read_at <= self.stale_s

    def read(self, started: float) -> float:
        """A poll that began at `started` read the log; returns how long the log had gone
        unread before it (seconds since the previous successful poll began)."""
        gap = started - self.read_at
        self.read_at = max(self.read_at, started)
        self.watches_ended = False
        floor = started - self.margin_s
        while self._landed and next(iter(self._landed.values()))[0] < floor:
            self._landed.popitem(last=False)
        return gap

    def outlived_history(self, gap_s: float) -> bool:
        """Whether a gap this long may have lost events the log no longer holds."""
        return gap_s >= self.history_s

    def landed(self, written: Iterable[tuple[str, Scope]]) -> None:
        """Keys a batched write just put into Milvus."""
        now = time.monotonic()
        for key, scope in written:
            self._landed[key] = (now, scope)
            self._landed.move_to_end(key)
        while len(self._landed) > LANDED_MAX:
            self._landed.popitem(last=False)

    def matching(self, ids: Iterable[str], scope: ScopeFilter | None) -> list[str]:
        """The recently written keys a peer's event names, by id or by scope."""
        named = [key for key in ids if key in self._landed]
        if scope is None:
            return named
        chosen = set(named)
        return named + [
            key
            for key, (_, held) in self._landed.items()
            if key not in chosen and scope.matches(held)
        ]

    def __len__(self) -> int:
        return len(self._landed)


async def guard_memory(sync: PeerSync, feed: WatchFeed, every_s: float) -> None:
    """Ends every watch stream once per outage of the peers' log, so no gateway serves its
    copy past `stale_s` either (WatchInvalidations refuses new ones meanwhile)."""
    while True:
        await asyncio.sleep(every_s)
        if sync.current() or sync.watches_ended:
            continue
        sync.watches_ended = True
        log.warning(
            "the other replicas' invalidations went unread: lookups read Milvus and watch "
            "streams end until the log is read again",
            extra={"unread_s": round(time.monotonic() - sync.read_at, 1)},
        )
        feed.end_all()
