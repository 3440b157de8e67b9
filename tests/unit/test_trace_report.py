"""`hopline trace report`'s analysis on hand-made OTLP JSON: the critical path and its
attribution, and the table of every hop (critical or not). Its CLI, run as a process, is
tests/mesh/test_trace_report_cli.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import PREDICT, otlp_request, otlp_resource, otlp_span
from hopline.cli.main import main
from hopline.observability.report import (
    Report,
    analyse,
    build_tree,
    critical_path,
    parse_otlp,
    table,
)


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


def hop(report: Report, *path: str) -> dict[str, Any]:
    """The hop table's row at `path` (hop, then service, then inner span)."""
    rows = [r for r in report.hops if r["path"] == list(path)]
    assert len(rows) == 1, [r["path"] for r in report.hops]
    return rows[0]


def test_hop_table_lists_every_hop_even_those_off_the_critical_path() -> None:
    docs = [otlp_request(f"{i:032x}") for i in range(1, 91)]
    docs += [otlp_request(f"{i:032x}", inference_ms=60.0) for i in range(91, 101)]
    report = analyse(parse_otlp(docs), above=90)
    # The slow requests' attribution is as before: the tokenizer never delayed a reply...
    assert report.top() == "inference"
    assert not [r for r in report.rows if r["name"] in ("tokenizer", "gap:tokenize")]
    # ...but the hop table, over all 100 traces, still lists it with its own durations.
    tokenize = hop(report, "tokenize")
    assert (tokenize["kind"], tokenize["service"], tokenize["depth"]) == ("client", "gateway", 0)
    assert tokenize["count"] == 100
    assert tokenize["p50_ms"] == pytest.approx(5.0)
    assert tokenize["p99_ms"] == pytest.approx(5.0)
    assert tokenize["critical_ms"] == 0.0
    assert tokenize["critical"] == 0.0
    tokenizer = hop(report, "tokenize", "tokenizer")
    assert (tokenizer["kind"], tokenizer["depth"], tokenizer["count"]) == ("server", 1, 100)
    assert tokenizer["p50_ms"] == pytest.approx(3.0)
    assert tokenizer["critical"] == 0.0
    # The cache lookup beside it held the path all along.
    lookup = hop(report, "cache_lookup")
    assert lookup["p50_ms"] == pytest.approx(20.0)
    assert lookup["critical_ms"] == pytest.approx(20.0)
    assert lookup["critical"] == pytest.approx(1.0)
    assert hop(report, "cache_lookup", "cache", "cache.search")["critical"] == pytest.approx(1.0)
    # Percentiles over every trace, not only the slow ones.
    inference = hop(report, "inference", "inference")
    assert inference["count"] == 100
    assert inference["p50_ms"] == pytest.approx(8.0)
    assert inference["p99_ms"] == pytest.approx(60.0)
    assert inference["critical"] == pytest.approx(1.0)
    assert hop(report, "inference", "inference", "inference.queue")["depth"] == 2
    # Each hop's rows together, hops in the order they start.
    assert [r["hop"] for r in report.hops if r["depth"] == 0] == [
        "cache_lookup",
        "tokenize",
        "inference",
        "postprocess",
    ]
    paths = [tuple(r["path"]) for r in report.hops]
    assert paths.index(("tokenize", "tokenizer")) == paths.index(("tokenize",)) + 1
    # The text and the JSON carry the table; the existing keys stay.
    text = table(report)
    assert "every hop over all 100 traces" in text
    line = next(x for x in text.splitlines() if x.startswith("tokenize "))
    assert line.split()[1:] == ["100", "5.00", "5.00", "0.00", "0.0%"]
    assert next(x for x in text.splitlines() if x.startswith("  tokenizer ")).endswith("0.0%")
    doc = json.loads(json.dumps(dataclasses.asdict(report)))
    assert set(doc) == {
        "traces",
        "selected",
        "threshold_ms",
        "percentile",
        "rows",
        "bands",
        "hops",
        "failed",
    }
    assert doc["hops"][1]["path"] == ["cache_lookup", "cache"]


def test_hop_table_charges_a_hop_only_while_it_delayed_the_reply() -> None:
    span, resource = otlp_span, otlp_resource

    def request(trace: str, tokenize_ms: float) -> dict[str, Any]:
        """Tokenize beside a 20 ms cache lookup, inference once both are done, and a cache
        store that outlives the reply."""
        ready = max(tokenize_ms, 20.0)
        return {
            "resourceSpans": [
                resource(
                    "gateway",
                    [
                        span(trace, 1, 0, PREDICT, 2, 0, ready + 10),
                        span(trace, 2, 1, "tokenize", 3, 0, tokenize_ms),
                        span(trace, 3, 1, "cache_lookup", 3, 0, 20),
                        span(trace, 4, 1, "inference", 3, ready, ready + 8),
                        span(trace, 5, 1, "cache_store", 3, ready + 9, ready + 40),
                    ],
                ),
                resource("cache", [span(trace, 6, 5, "Store", 2, ready + 10, ready + 39)]),
            ]
        }

    # Tokenization beside the lookup: off the path at 5 ms, the whole path at 30 ms.
    report = analyse(parse_otlp([request("a" * 32, 5.0), request("b" * 32, 30.0)]), above=0)
    tokenize = hop(report, "tokenize")
    assert tokenize["count"] == 2
    assert tokenize["critical_ms"] == pytest.approx(15.0)  # (0 + 30) / 2
    assert tokenize["critical"] == pytest.approx(30.0 / 35.0)
    lookup = hop(report, "cache_lookup")
    assert lookup["critical"] == pytest.approx(0.5)  # on the path in one request of two
    assert hop(report, "inference")["critical"] == pytest.approx(1.0)
    # The store finishes after the reply: listed, never critical, nor is the work under it.
    store = hop(report, "cache_store")
    assert (store["count"], store["p50_ms"], store["critical"]) == (2, pytest.approx(31.0), 0.0)
    assert hop(report, "cache_store", "cache")["critical"] == 0.0
    # A span under no hop (the stream's per-message span) is a row of its own.
    stream = parse_otlp(
        [
            {
                "resourceSpans": [
                    resource(
                        "gateway",
                        [
                            span("c" * 32, 1, 0, "Stream", 2, 0, 30),
                            span("c" * 32, 2, 1, "gateway.stream_message", 1, 1, 12),
                            span("c" * 32, 3, 2, "inference", 3, 2, 10),
                        ],
                    )
                ]
            }
        ]
    )
    rows = analyse(stream, above=0).hops
    assert [(r["path"], r["kind"]) for r in rows] == [
        (["gateway.stream_message"], "internal"),
        (["inference"], "client"),
    ]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b'{"resourceSpans": [', "is not OTLP/JSON: Expecting value"),
        (b"\xff\xfe", "is not OTLP/JSON: not UTF-8 text"),
        (b"[1, 2]", "document 1 is not OTLP/JSON TracesData"),
        (b'{"resourceSpans": 5}', "document 1 is not OTLP/JSON TracesData"),
        (
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x"}]}]}]}',
            "document 1 is not OTLP/JSON: a span has no 'traceId'",
        ),
    ],
)
def test_a_file_that_is_not_otlp_json_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, said: str
) -> None:
    path = tmp_path / "traces.json"
    path.write_bytes(content)
    assert main(["trace", "report", "--file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}"), err
    assert said in err
    assert "Traceback" not in err


def test_a_file_that_cannot_be_read_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "report", "--file", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: cannot read {tmp_path}: Is a directory\n"


def _batched_pair() -> list[dict[str, Any]]:
    """Two requests whose inference went in one stage batch: recorded under the first's hop
    (client -> gateway.stage_batch -> server), linked from both hops; the second's hop has no
    server span in its own trace. The model took 30 of each hop's 32 ms."""
    span, resource = otlp_span, otlp_resource
    first, second = f"{1:032x}", f"{2:032x}"
    batch = span(first, 3, 2, "gateway.stage_batch", 1, 0.5, 31.5)
    batch["links"] = [
        {"traceId": first, "spanId": f"{2:016x}"},
        {"traceId": second, "spanId": f"{12:016x}"},
    ]
    batch["attributes"] = [{"key": "hopline.hop", "value": {"stringValue": "inference"}}]
    return [
        {
            "resourceSpans": [
                resource(
                    "gateway",
                    [
                        span(first, 1, 0, PREDICT, 2, 0, 34),
                        span(first, 2, 1, "inference", 3, 0, 32),
                        batch,
                    ],
                ),
                resource("inference", [span(first, 4, 3, "Infer", 2, 1, 31)]),
            ]
        },
        {
            "resourceSpans": [
                resource(
                    "gateway",
                    [
                        span(second, 11, 0, PREDICT, 2, 0, 34),
                        span(second, 12, 11, "inference", 3, 0, 32),
                    ],
                ),
            ]
        },
    ]


def test_a_batched_hop_is_charged_to_its_service_in_every_request_it_served() -> None:
    """Before, every request but the one the batch was recorded under read its model time as
    `gap:inference` (network), and the service's row counted one request in two."""
    report = analyse(parse_otlp(_batched_pair()), above=0)
    rows = {r["name"]: r for r in report.rows}
    assert rows["inference"]["count"] == 2
    assert rows["inference"]["p50_ms"] == pytest.approx(30.0)
    assert rows["gap:inference"]["p50_ms"] == pytest.approx(2.0)  # 32 - 30, in both
    assert rows["inference"]["critical_ms"] == pytest.approx(30.0)
    # The batch RPC's time outside its server is the hop's gap, not the gateway's work.
    assert rows["gap:inference"]["critical_ms"] == pytest.approx(2.0)
    assert rows["gateway"]["critical_ms"] == pytest.approx(2.0)
    assert hop(report, "inference", "inference")["count"] == 2


def test_a_store_batchs_own_call_is_a_row_under_the_store_not_the_store_again() -> None:
    """The store queue's batch opens its own cache_store client span under the request's:
    it was counted as a second cache_store (count 2, a p50 between the two), and its server
    span, after the reply, in the cache's row of the request's own times."""
    span, resource = otlp_span, otlp_resource
    trace = f"{3:032x}"
    docs = [
        {
            "resourceSpans": [
                resource(
                    "gateway",
                    [
                        span(trace, 1, 0, PREDICT, 2, 0, 10),
                        span(trace, 2, 1, "cache_lookup", 3, 0, 4),
                        span(trace, 5, 1, "cache_store", 3, 9, 500),
                        span(trace, 6, 5, "gateway.store_batch", 1, 480, 495),
                        span(trace, 7, 6, "cache_store", 3, 481, 494),
                    ],
                ),
                resource(
                    "cache",
                    [
                        span(trace, 3, 2, "Lookup", 2, 1, 3),
                        span(trace, 8, 7, "StoreBatch", 2, 482, 493),
                    ],
                ),
            ]
        }
    ]
    report = analyse(parse_otlp(docs), above=0)
    store = hop(report, "cache_store")
    assert store["count"] == 1
    assert store["p50_ms"] == pytest.approx(491.0)
    inner = hop(report, "cache_store", "gateway.store_batch", "cache_store")
    assert (inner["count"], inner["depth"]) == (1, 2)
    rows = {r["name"]: r for r in report.rows}
    assert rows["cache"]["count"] == 1  # the Lookup alone: the store came after the reply
    assert rows["cache"]["p50_ms"] == pytest.approx(2.0)


def test_a_hop_cut_by_the_clients_deadline_is_charged_not_dropped() -> None:
    """The client's deadline ends the request, and its waiting hop a fraction of a
    millisecond later: the hop outlives the root by that much. It was read as
    fire-and-forget work (a cache store) and the whole 500 ms charged to the gateway
    (a helper's traces: `gateway 500.29 ms 100%` for a stalled tokenizer)."""
    trace = "c" * 32
    span, resource = otlp_span, otlp_resource
    request = {
        "resourceSpans": [
            resource(
                "gateway",
                [
                    span(trace, 1, 0, PREDICT, 2, 0, 500.0),
                    span(trace, 2, 1, "tokenize", 3, 0.1, 500.3),  # cut 0.3 ms after the root
                    span(trace, 3, 1, "cache_store", 3, 499.0, 530.0),  # after the reply
                ],
            ),
        ]
    }
    root = build_tree(parse_otlp([request])[trace])
    assert root is not None
    path = critical_path(root)
    assert path["gap:tokenize"] == pytest.approx(499.9)
    assert path["gateway"] == pytest.approx(0.1)
    assert "gap:cache_store" not in path


def test_a_colocated_stage_is_charged_to_its_service_not_the_gateways_process() -> None:
    """Co-located, the tokenizer, inference and postprocess servers run in the gateway's
    process, whose resource names every span `gateway`: the report put every stage's time in
    the gateway's row (an observability probe: 800 server spans for 200 traces, 99.7% of the
    tail). A server span of a hopline service is charged to that service, by its
    `rpc.service`, as in five processes."""
    trace = "c" * 32
    five = otlp_request(trace)
    served = {
        "Tokenize": "hopline.tokenizer.v1.TokenizerService",
        "Infer": "hopline.inference.v1.InferenceService",
        "Postprocess": "hopline.postprocess.v1.PostprocessService",
        "Lookup": "hopline.cache.v1.CacheService",
    }
    spans_of: dict[str, list[dict[str, Any]]] = {}
    for rs in five["resourceSpans"]:
        name = rs["resource"]["attributes"][0]["value"]["stringValue"]
        spans_of[name] = rs["scopeSpans"][0]["spans"]
        for span in spans_of[name]:
            if span["name"] in served:
                span["attributes"] = [
                    {"key": "rpc.service", "value": {"stringValue": served[span["name"]]}}
                ]
    colocated = {
        "resourceSpans": [
            otlp_resource(
                "gateway",
                [
                    *spans_of["gateway"],
                    *spans_of["tokenizer"],
                    *spans_of["inference"],
                    *spans_of["postprocess"],
                ],
            ),
            otlp_resource("cache", spans_of["cache"]),
        ]
    }
    expected = critical_path(build_tree(parse_otlp([otlp_request(trace)])[trace]))  # type: ignore[arg-type]
    root = build_tree(parse_otlp([colocated])[trace])
    assert root is not None
    path = critical_path(root)
    assert path == pytest.approx(expected)
    assert path["inference"] == pytest.approx(8.0)
    assert path["gateway"] == pytest.approx(2.0)
