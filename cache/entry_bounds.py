"""When the cache counts a (tenant, model)'s entries in Milvus, and how many it evicts.

Each (tenant, model) holds at most its `max_entries`, oldest first out. Counting the entries
and finding the oldest are full scans of the scope's rows in Milvus (a count with a filter,
then every row's id and age, sorted here): done after every batched write, as before stop 58,
a full 100,000-entry cache on the project's 2-core VM spent more of its CPU on them than on
the stores (milvus-lite 1.9 -> 16.7% of a core, the cache 5.1 -> 9.5%, the kernel's page
work about 12% more) and a co-located mesh's misses at 32 callers fell from 322-331 to
265-270 rps. So:

- the count is kept here between measurements: the last one plus every row written since
  (replaced keys counted too, so it only errs high: an entry expired or invalidated since
  is still counted until the next measurement); Milvus is counted again only when that
  passes the bound, or, over a Milvus server, `refresh_s` after the last count, so that
  other replicas' writes are seen within it. A milvus-lite file has one writer, this
  cache, so there its count is never refreshed by age (`refresh_s` infinite): with 100
  tenants at bounds of 1,000 and 300 stores a second across them, the counts every 10 s
  (about 8 ms of milvus-lite each, a filtered scan of 100,000 rows) had cost 0.440 ms of
  its CPU a store against 0.359 without them (medians of 6 alternated rounds of 15 s, two
  cache services side by side; lower in all six pairs);
- a scope over its bound gives up its oldest down to `HEADROOM` below the bound (5%, none
  under 20 entries), so eviction runs once per that many stores, not on every write. A
  delete in milvus-lite 2.5.1 costs its server about 2 ms of CPU per 1,000 rows in the
  collection, whatever it deletes (a 100,000-row collection: 200-230 ms for 1,000 ids, 290
  ms for 3,000): at 1% a full cache spent about 0.2 ms of milvus-lite's CPU per store.

Past PRUNE_AT groups (many tenants) the counts older than `refresh_s`, which would be taken
again anyway, are dropped, so memory follows the groups written lately; with no refresh, the
half counted longest ago (each is counted again at its next write).

A milvus-lite file may also be bounded as a whole (`HOPLINE_CACHE_MAX_TOTAL_ENTRIES`): its
server holds every row in memory in the cache's own container, about 2.6 KiB a row, and the
per-scope bounds add up without limit as tenants come. Past that bound the groups holding the
most give up their oldest (`fair_shares`), so a tenant within its fair share of the file never
loses an entry to another's traffic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

Group = tuple[str, str]  # tenant, model
HEADROOM = 0.05  # of the bound, evicted beyond what it takes to get back under it
COUNT_REFRESH_S = 10.0
PRUNE_AT = 1024  # groups held before the stale counts are dropped


@dataclasses.dataclass(slots=True)
class _Count:
    measured: int
    at: float  # monotonic seconds
    written: int = 0  # rows written by this replica since

    @property
    def at_most(self) -> int:
        return self.measured + self.written


def eviction_size(count: int, limit: int) -> int:
    """How many of `count` entries to evict for a bound of `limit`."""
    if count <= limit:
        return 0
    return count - limit + int(limit * HEADROOM)


def fair_shares(counts: Mapping[Group, int], excess: int) -> dict[Group, int]:
    """How many of its entries each group gives up so that `excess` go in all, the largest
    first: every group above a common level comes down to it (ties broken by the group's
    name), and no group at or below it gives up any."""
    if excess <= 0:
        return {}
    if excess >= sum(counts.values()):
        return {group: count for group, count in counts.items() if count}

    def above(level: int) -> int:
        return sum(count - level for count in counts.values() if count > level)

    low, high = 0, max(counts.values())  # above(high) == 0 <= excess < above(0)
    while low < high:  # the lowest level whose entries above it are at most `excess`
        middle = (low + high) // 2
        if above(middle) <= excess:
            high = middle
        else:
            low = middle + 1
    level = low
    shares = {group: count - level for group, count in counts.items() if count > level}
    # One more from as many of the groups at or above the level as are still short; there are
    # enough, since one level lower would have taken more than `excess`.
    rest = excess - sum(shares.values())
    at_level = sorted(group for group, count in counts.items() if count >= level)
    for group in at_level[:rest]:
        shares[group] = shares.get(group, 0) + 1
    return shares


def total_bound_problem(
    bound: int, *, local: bool, index_room: int | None, batch: int
) -> str | None:
    """Why `HOPLINE_CACHE_MAX_TOTAL_ENTRIES` cannot be kept with these settings; None when it
    can (or is 0, no bound). The exact index's per-group counts are what it is kept by, so
    the index must hold every entry with a batched write's rows (`batch`) to spare, and
    this process must be the file's one writer."""
    if not bound:
        return None
    name = "HOPLINE_CACHE_MAX_TOTAL_ENTRIES"
    if not local:
        return (
            f"{name} bounds a milvus-lite file, whose server holds its rows in this "
            "container's memory; a Milvus server's memory is sized on the server: unset it"
        )
    if index_room is None:
        return f"{name} is kept by the exact index's counts: set HOPLINE_CACHE_EXACT_INDEX=true"
    if bound + batch > index_room:
        return (
            f"{name}={bound} needs HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES of at least "
            f"{bound + batch} (the bound and one batched write's {batch} rows; it is "
            f"{index_room}): the index must hold every entry the bound counts"
        )
    return None


class EntryBounds:
    """Each group's entry count between measurements in the store."""

    def __init__(self, refresh_s: float = COUNT_REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._counts: dict[Group, _Count] = {}
        self._prune_at = PRUNE_AT

    def __len__(self) -> int:
        """Groups whose count is held."""
        return len(self._counts)

    def wrote(self, group: Group, rows: int) -> None:
        """`rows` stored into the group (new or replacing an entry)."""
        if (count := self._counts.get(group)) is not None:
            count.written += rows

    def needs_count(self, group: Group, limit: int, now: float) -> bool:
        """Whether the group may be over `limit` now, or its count is too old to tell."""
        count = self._counts.get(group)
        return count is None or count.at_most > limit or now - count.at >= self.refresh_s

    def counted(self, group: Group, entries: int, now: float) -> None:
        self._counts[group] = _Count(entries, now)
        if len(self._counts) > self._prune_at:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """With many tenants, only the groups counted lately are held."""
        if math.isinf(self.refresh_s):
            latest = sorted(self._counts.items(), key=lambda item: item[1].at)
            self._counts = dict(latest[len(latest) - PRUNE_AT // 2 :])
        else:  # a count past `refresh_s` is taken again anyway
            self._counts = {g: c for g, c in self._counts.items() if now - c.at < self.refresh_s}
        self._prune_at = max(PRUNE_AT, 2 * len(self._counts))

    def evicted(self, group: Group, rows: int) -> None:
        if (count := self._counts.get(group)) is not None:
            count.measured = max(0, count.measured - rows)

    def forget(self, group: Group) -> None:
        """The group's count is unknown (a delete removed fewer rows than it was given): it is
        counted again at its next write."""
        self._counts.pop(group, None)
