"""`hopline trace report` on hand-made OTLP JSON: the critical path and its attribution."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hopline.observability.report import analyse, build_tree, critical_path, parse_otlp

MS = 1_000_000
PREDICT = "hopline.gateway.v1.GatewayService/Predict"
STATS = "hopline.gateway.v1.GatewayService/GetStats"
T0 = 1_700_000_000_000_000_000


def span(
    trace: str, sid: int, parent: int, name: str, kind: int, start_ms: float, end_ms: float
) -> dict[str, Any]:
    return {
        "traceId": trace,
        "spanId": f"{sid:016x}",
        "parentSpanId": f"{parent:016x}" if parent else "",
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(T0 + round(start_ms * MS)),
        "endTimeUnixNano": str(T0 + round(end_ms * MS)),
    }


def resource(service: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"spans": spans}],
    }


def request(trace: str, inference_ms: float = 8.0) -> dict[str, Any]:
    """A miss: tokenize and the cache lookup together, then inference (slow or not), then
    postprocess, then 2 ms of the gateway's own work."""
    inf_end = 21 + inference_ms
    return {
        "resourceSpans": [
            resource(
                "gateway",
                [
                    span(trace, 1, 0, PREDICT, 2, 0, inf_end + 7),
                    span(trace, 2, 1, "tokenize", 3, 0, 5),
                    span(trace, 3, 1, "cache_lookup", 3, 0, 20),
                    span(trace, 4, 1, "inference", 3, 20, inf_end + 1),
                    span(trace, 5, 1, "postprocess", 3, inf_end + 1, inf_end + 5),
                ],
            ),
            resource("tokenizer", [span(trace, 6, 2, "Tokenize", 2, 1, 4)]),
            resource(
                "cache",
                [
                    span(trace, 7, 3, "Lookup", 2, 1, 19),
                    span(trace, 8, 7, "cache.search", 1, 10, 18),
                ],
            ),
            resource(
                "inference",
                [
                    span(trace, 9, 4, "Infer", 2, 21, inf_end),
                    span(trace, 10, 9, "inference.queue", 1, 21, 22),
                    span(trace, 11, 9, "inference.run", 1, 22, inf_end),
                ],
            ),
            resource(
                "postprocess", [span(trace, 12, 5, "Postprocess", 2, inf_end + 2, inf_end + 4)]
            ),
        ]
    }


def test_critical_path_charges_only_what_delayed_the_reply() -> None:
    traces = parse_otlp([request("a" * 32)])
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


def test_report_names_the_hop_that_owns_the_tail(tmp_path: Path) -> None:
    docs = [request(f"{i:032x}") for i in range(1, 91)]
    docs += [request(f"{i:032x}", inference_ms=60.0) for i in range(91, 101)]
    # Slow admin calls are traced too, but they are not requests: the default leaves them out.
    docs += [
        {"resourceSpans": [resource("gateway", [span(f"{i:032x}", 1, 0, STATS, 2, 0, 500)])]}
        for i in range(101, 106)
    ]
    assert analyse(parse_otlp(docs), above=90).traces == 105
    with pytest.raises(ValueError, match="root operation 'Nope'"):
        analyse(parse_otlp(docs), above=90, operation="Nope")
    report = analyse(parse_otlp(docs), above=90, operation=PREDICT)
    assert report.traces == 100
    assert report.selected == 10
    assert report.top() == "inference"
    inference = next(r for r in report.rows if r["name"] == "inference")
    assert inference["critical_ms"] == pytest.approx(60.0)
    assert inference["p50_ms"] == pytest.approx(60.0)
    # The CLI reads the same from an OTLP JSON file (lines of TracesData) and draws the bands.
    path, png = tmp_path / "traces.jsonl", tmp_path / "bands.png"
    path.write_text("\n".join(json.dumps(d) for d in docs))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "trace",
            "report",
            "--file",
            str(path),
            "--above",
            "p90",
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "10 of 100 traces at or above p90" in run.stdout
    first_row = run.stdout.splitlines()[3]
    assert first_row.startswith("inference"), run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_an_empty_input(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text('{"resourceSpans": []}')
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "trace", "report", "--file", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1
    assert "no traces" in run.stderr
