"""`hopline trace report` as a user runs it, a process reading hand-made OTLP JSON files: the
hop that owns the tail, the table of every hop, an empty input refused, and an address where
no Jaeger answers named. The analysis itself is unit-tested in tests/unit/test_trace_report.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PREDICT, STATS, otlp_request, otlp_resource, otlp_span
from harness import free_port
from hopline.observability.report import analyse, parse_otlp


def test_report_names_the_hop_that_owns_the_tail(tmp_path: Path) -> None:
    docs = [otlp_request(f"{i:032x}") for i in range(1, 91)]
    docs += [otlp_request(f"{i:032x}", inference_ms=60.0) for i in range(91, 101)]
    # Slow admin calls are traced too, but they are not requests: the default leaves them out.
    docs += [
        {
            "resourceSpans": [
                otlp_resource("gateway", [otlp_span(f"{i:032x}", 1, 0, STATS, 2, 0, 500)])
            ]
        }
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
    path, png, out = tmp_path / "traces.jsonl", tmp_path / "bands.png", tmp_path / "report.json"
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
            "--json",
            str(out),
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
    # Below it, every hop over all the traces: the tokenizer beside the cache lookup too.
    assert "every hop over all 100 traces" in run.stdout
    tokenize = next(x for x in run.stdout.splitlines() if x.startswith("tokenize "))
    assert tokenize.split()[1:] == ["100", "5.00", "5.00", "0.00", "0.0%"], run.stdout
    written = json.loads(out.read_text())
    assert written["rows"][0]["name"] == "inference"
    hops = {tuple(h["path"]): h for h in written["hops"]}
    assert hops[("tokenize",)]["critical"] == 0.0
    assert hops[("tokenize", "tokenizer")]["p99_ms"] == pytest.approx(3.0)
    assert hops[("inference", "inference")]["p99_ms"] == pytest.approx(60.0)


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


def test_report_says_where_it_looked_for_jaeger() -> None:
    """No Jaeger at the address: which address, why, and how to start one; no traceback."""
    address = f"http://127.0.0.1:{free_port()}"
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "trace", "report", "--jaeger", address],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1
    assert f"cannot reach Jaeger's query API at {address}" in run.stderr, run.stderr
    assert "make jaeger" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
