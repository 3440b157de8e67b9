"""The cache service's counts (cache/counts.py): one call counts an event for GetStats (this
service's own count) and for Prometheus (the process's series), so the two cannot drift."""

from __future__ import annotations

from prometheus_client import generate_latest

from hopline.cache.counts import TIERS, CacheCount, CacheCounts
from hopline.cache.service import STATS_COUNTS
from hopline.observability import metrics
from hopline.protos.hopline.cache.v1 import cache_pb2


def _series() -> dict[CacheCount, int]:
    """The process's Prometheus count of each event."""
    return {
        count: metrics.count(metrics.CACHE_LOOKUPS, tier=TIERS[count])
        if count in TIERS
        else metrics.count(metrics.CACHE_EVENTS, event=count.value)
        for count in CacheCount
    }


def test_a_count_reaches_getstats_and_prometheus_alike() -> None:
    before = _series()
    mine, other = CacheCounts(), CacheCounts()

    mine.add(CacheCount.EXACT_HITS)
    mine.add(CacheCount.STORE_ERRORS, 3)
    other.add(CacheCount.STORE_ERRORS)
    mine.add(CacheCount.AMBIGUOUS, 0)

    assert {c: mine[c] for c in CacheCount if mine[c]} == {
        CacheCount.EXACT_HITS: 1,
        CacheCount.STORE_ERRORS: 3,
    }
    assert {c: other[c] for c in CacheCount if other[c]} == {CacheCount.STORE_ERRORS: 1}
    added = {c: n - before[c] for c, n in _series().items() if n != before[c]}
    # The process's series sum every cache service in it (one, outside tests).
    assert added == {CacheCount.EXACT_HITS: 1, CacheCount.STORE_ERRORS: 4}


def test_every_event_is_exposed_from_the_start_and_answers_keep_their_tier_series() -> None:
    CacheCounts()
    exposed = generate_latest().decode()
    for count in CacheCount:
        if count in TIERS:
            assert f'hopline_cache_lookups_total{{tier="{TIERS[count]}"}}' in exposed
            assert f'event="{count.value}"' not in exposed
        else:
            assert f'hopline_cache_events_total{{event="{count.value}"}}' in exposed


def test_getstats_has_a_field_for_each_count_it_reported_before() -> None:
    fields = cache_pb2.GetStatsResponse.DESCRIPTOR.fields_by_name
    assert {c.value for c in STATS_COUNTS} == {
        "lookups",
        "exact_hits",
        "semantic_hits",
        "misses",
        "ambiguous",
        "stores",
        "store_errors",
        "evictions",
        "reclaims",
        "write_retries",
        "memory_searches",
        "milvus_searches",
        "expirations",
    }
    assert all(fields[c.value].type == fields["lookups"].type for c in STATS_COUNTS)
