"""The cache service's counts. One call counts an event twice over: for GetStats, this
service's count since it started, and for Prometheus, the process's series (a lookup's answer
in `hopline_cache_lookups_total{tier}`, everything else in `hopline_cache_events_total{event}`),
so a scrape and GetStats are kept by the same line of code.

Every count is made on the service's event loop (the Prometheus side is a LoopCounter).
"""

from __future__ import annotations

import enum

from hopline.observability import metrics


class CacheCount(enum.Enum):
    """What the cache counts; the value names it in GetStats' fields and Prometheus' labels."""

    LOOKUPS = "lookups"  # Lookup requests taken (each ends as one of the three answers or fails)
    EXACT_HITS = "exact_hits"
    SEMANTIC_HITS = "semantic_hits"
    MISSES = "misses"
    STORES = "stores"  # stores taken into the pending writes
    STORES_FENCED = "stores_fenced"  # stores not taken: their entry was invalidated a moment ago
    STORE_ERRORS = "store_errors"  # taken stores Milvus never got
    EVICTIONS = "evictions"  # entries deleted to keep a scope (or a whole file) within its bound
    EVICTION_SCANS = "eviction_scans"  # evictions that scanned Milvus for the oldest entries
    FILE_EVICTIONS = "file_evictions"  # of the evictions, those for the whole file's bound
    WRITES_HELD = "writes_held"  # times the writer held stores back for a reclaim's journal
    EXPIRATIONS = "expirations"  # entries the sweep deleted past their TTL
    STORE_EMBEDDINGS = "store_embeddings"  # stores whose vector the encoder ran for
    AMBIGUOUS = "ambiguous"  # semantic candidates refused for disagreeing close neighbours
    UNSEEN_MISMATCHES = "unseen_mismatches"  # candidates refused by the unseen-text check
    INDEX_HITS = "index_hits"  # exact hits answered by the in-memory index
    EXACT_READS = "exact_reads"  # exact lookups that read Milvus by key (no index, or fallback)
    INDEX_REBUILT = "index_rebuilt"  # entries the start-up rebuild put into the index
    RECLAIMS = "reclaims"  # milvus-lite collections rebuilt to free deleted rows
    BURIED = "buried"  # entries a lookup read from Milvus after they were deleted
    WRITE_RETRIES = "write_retries"  # batched writes Milvus failed, their rows written again
    MEMORY_SEARCHES = "memory_searches"  # semantic searches answered by the in-memory vectors
    MILVUS_SEARCHES = "milvus_searches"  # semantic searches that went to Milvus
    VECTORS_READ = "vectors_read"  # vectors read back from Milvus into memory after a start


# A lookup's three answers keep the series they have had since the cache had a metric.
TIERS = {
    CacheCount.EXACT_HITS: "exact",
    CacheCount.SEMANTIC_HITS: "semantic",
    CacheCount.MISSES: "miss",
}


class CacheCounts:
    """One cache service's counts since it started, each also added to its Prometheus series."""

    __slots__ = ("_series", "_values")

    def __init__(self) -> None:
        self._values = dict.fromkeys(CacheCount, 0)
        self._series = {
            count: (
                metrics.CACHE_LOOKUPS.labels(TIERS[count])
                if count in TIERS
                else metrics.CACHE_EVENTS.labels(count.value)
            )
            for count in CacheCount
        }

    def add(self, count: CacheCount, amount: int = 1) -> None:
        self._values[count] += amount
        self._series[count].inc(amount)

    def __getitem__(self, count: CacheCount) -> int:
        return self._values[count]
