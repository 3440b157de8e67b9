"""What one process's /metrics shows (observability/metrics.py:ProcessView): the families of
the services it runs, co-located ones included, and none of another service's."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from hopline.observability.metrics import OWNED_BY, ProcessView
from hopline.runtime.service_table import ServiceName


def families(view: ProcessView) -> set[str]:
    return {f.name for f in parse_text(generate_latest(view).decode())}


def test_a_gateway_with_the_cache_in_it_shows_both_services_families() -> None:
    shown = families(ProcessView({ServiceName.GATEWAY, ServiceName.CACHE}))
    assert set(OWNED_BY) <= shown


def test_a_tokenizer_shows_neither_the_gateways_nor_the_caches() -> None:
    shown = families(ProcessView({ServiceName.TOKENIZER}))
    assert not set(OWNED_BY) & shown
    assert "hopline_rpc_duration_seconds" in shown  # every service's own


def test_a_scrape_of_named_families_leaves_out_the_same() -> None:
    view = ProcessView({ServiceName.INFERENCE})
    restricted = view.restricted_registry(
        [
            "hopline_gateway_in_flight",
            "hopline_coalesced_total",
            "hopline_trace_sampling_updates_total",
        ]
    )
    names = {f.name for f in restricted.collect()}
    assert names == {"hopline_trace_sampling_updates"}
