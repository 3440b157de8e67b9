"""`hopline trace report`'s analysis on hand-made OTLP JSON: the critical path and its
attribution. Its CLI, run as a process, is tests/mesh/test_trace_report_cli.py."""

from __future__ import annotations

import pytest

from conftest import otlp_request
from hopline.observability.report import build_tree, critical_path, parse_otlp


def test_critical_path_charges_only_what_delayed_the_reply() -> None:
    traces = parse_otlp([otlp_request("a" * 32)])
    root = build_tree(traces["a" * 32])
    assert root is not None
    path = critical_path(root)
    top = {k: round(v, 6) for k, v in path.items() if not k.startswith("  ")}
    assert top == {
        "gateway": 2.0,  # after postprocess
        "gap:cache_lookup": 2.0,
        "cache": 18.0,
        "gap:inference": 2.0,
        "inference": 8.0,
        "gap:postprocess": 2.0,
        "postprocess": 2.0,
    }
    assert sum(top.values()) == pytest.approx(root.ms)
    # Tokenization ran beside the slower cache lookup: it delayed nothing.
    assert "tokenizer" not in path
    assert path["  cache.search"] == pytest.approx(8.0)
    assert path["  inference.run"] == pytest.approx(7.0)
    assert path["  inference.queue"] == pytest.approx(1.0)
