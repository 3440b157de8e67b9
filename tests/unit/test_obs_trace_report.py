"""`hopline trace report` with failed requests among the traces, and what it says for input
it cannot use: a --limit Jaeger refuses, a --jaeger URL that is not Jaeger's query API, a
--file that is not OTLP/JSON. Jaeger's answers are stood in for (no sockets in this lane)."""

from __future__ import annotations

import email.message
import io
import json
import socket
import struct
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import PREDICT, otlp_request, otlp_resource, otlp_span
from hopline.cli.main import main
from hopline.observability.report import analyse, fetch_jaeger, parse_otlp, table

UNAVAILABLE = 14


def _failed_request(trace: str, code: int = UNAVAILABLE, error: bool = True) -> dict[str, Any]:
    """A Predict whose postprocess hop never reached its server: 40 ms of the gateway's
    client span (connection attempts), no postprocess server span, the root failed."""
    span = otlp_span
    root = span(trace, 1, 0, PREDICT, 2, 0, 72)
    root["attributes"] = [{"key": "rpc.grpc.status_code", "value": {"intValue": str(code)}}]
    if error:
        root["status"] = {"code": "STATUS_CODE_ERROR", "message": "UNAVAILABLE"}
    return {
        "resourceSpans": [
            otlp_resource(
                "gateway",
                [
                    root,
                    span(trace, 2, 1, "cache_lookup", 3, 0, 20),
                    span(trace, 4, 1, "inference", 3, 20, 30),
                    span(trace, 5, 1, "postprocess", 3, 30, 70),
                ],
            ),
            otlp_resource("cache", [span(trace, 7, 2, "Lookup", 2, 1, 19)]),
            otlp_resource("inference", [span(trace, 9, 4, "Infer", 2, 21, 29)]),
        ]
    }


def _mixed() -> list[dict[str, Any]]:
    """10 answered requests (postprocess's gap 2 ms of 36) and 5 that failed."""
    docs = [otlp_request(f"{i:032x}") for i in range(1, 11)]
    return docs + [_failed_request(f"{i:032x}") for i in range(11, 16)]


def test_failed_requests_are_left_out_of_the_attribution_and_counted() -> None:
    """They were the slowest, so `--above p50` was mostly them, and their postprocess
    connection attempts read as `gap:postprocess`, as if it were network time."""
    report = analyse(parse_otlp(_mixed()), above=50)
    assert (report.traces, report.failed) == (10, 5)
    rows = {r["name"]: r for r in report.rows}
    assert rows["gap:postprocess"]["share"] == pytest.approx(2 / 36)
    assert rows["gap:postprocess"]["p50_ms"] == pytest.approx(2.0)
    assert "5 failed requests left out" in table(report)
    assert all(h["count"] == 10 for h in report.hops if h["name"] == "postprocess")

    everything = analyse(parse_otlp(_mixed()), above=50, include_failed=True)
    assert (everything.traces, everything.failed) == (15, 0)
    # Every request is at or above p50 (36 ms): the failed ones' 40 ms gaps dominate.
    share = (10 * 2 + 5 * 40) / (10 * 36 + 5 * 72)
    assert {r["name"]: r for r in everything.rows}["gap:postprocess"]["share"] == pytest.approx(
        share
    )
    assert "failed requests" not in table(everything)


def test_a_root_with_a_non_ok_code_is_failed_even_when_not_an_error() -> None:
    """A caller's mistake (INVALID_ARGUMENT) is not an error on the server span, but its
    reply is no answered request's latency either."""
    docs = [otlp_request(f"{i:032x}") for i in range(1, 4)]
    docs.append(_failed_request(f"{9:032x}", code=3, error=False))
    report = analyse(parse_otlp(docs), above=0)
    assert (report.traces, report.failed) == (3, 1)


def test_a_request_out_of_time_is_the_tail_not_a_failure_left_out() -> None:
    """DEADLINE_EXCEEDED is an error on the span, but it is the slow request this report is
    for: left out, a hung hop's requests would vanish from its tail."""
    docs = [otlp_request(f"{i:032x}") for i in range(1, 4)]
    docs.append(_failed_request(f"{9:032x}", code=4))
    report = analyse(parse_otlp(docs), above=0)
    assert (report.traces, report.failed) == (4, 0)


def test_the_cli_leaves_failed_requests_out_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "traces.json"
    path.write_text("\n".join(json.dumps(d) for d in _mixed()))
    out = tmp_path / "report.json"
    assert main(["trace", "report", "--file", str(path), "--above", "p50", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "of 10 traces" in said
    assert "5 failed requests left out (--errors include" in said
    assert json.loads(out.read_text())["failed"] == 5
    args = ["trace", "report", "--file", str(path), "--above", "p50", "--errors", "include"]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "of 15 traces" in said
    assert "failed requests" not in said


def test_traces_that_all_failed_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "traces.json"
    path.write_text(json.dumps([_failed_request(f"{i:032x}") for i in range(1, 4)]))
    assert main(["trace", "report", "--file", str(path)]) == 1
    err = capsys.readouterr().err
    assert "no traces to report on" in err
    assert "all 3 failed (--errors include" in err


@pytest.mark.parametrize("limit", ["0", "-3", "ten"])
def test_a_limit_below_one_is_refused_by_the_parser(
    limit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Jaeger answered a search depth of 0 or less with HTTP 500, which the report printed."""
    with pytest.raises(SystemExit) as exited:
        main(["trace", "report", "--jaeger", "http://127.0.0.1:1", "--limit", limit])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --limit: a number of traces, 1 or more, got '{limit}'" in err


class _Reply(io.BytesIO):
    def __enter__(self) -> _Reply:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _answering(
    monkeypatch: pytest.MonkeyPatch, status: int, body: bytes, asked: list[str] | None = None
) -> None:
    """urlopen answers `status` with `body`, as the server at the URL would."""

    def urlopen(url: str, timeout: float) -> _Reply:
        if asked is not None:
            asked.append(url)
        if status == 200:
            return _Reply(body)
        raise urllib.error.HTTPError(url, status, "", email.message.Message(), io.BytesIO(body))

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


PAGE = b"<!DOCTYPE html>\n<html><title>Test Page</title></html>\n"
JAEGER_404 = b'{"error":{"httpCode":404,"message":"No traces found"}}\n'


def test_jaegers_no_traces_answer_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    _answering(monkeypatch, 404, JAEGER_404, asked)
    assert fetch_jaeger("http://127.0.0.1:16686/", "gateway", 60, 5) == []
    assert asked[0].startswith("http://127.0.0.1:16686/api/v3/traces?")


def test_jaegers_traces_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    body = json.dumps({"result": otlp_request("a" * 32)}).encode()
    _answering(monkeypatch, 200, body)
    docs = fetch_jaeger("http://127.0.0.1:16686", "gateway", 60, 5)
    assert list(parse_otlp(docs)) == ["a" * 32]


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        # --jaeger http://host:16686/api: Jaeger's placeholder UI answers every other path.
        (200, PAGE, "did not answer with Jaeger's query API JSON"),
        (200, b'{"data": [], "total": 0}', "did not answer with Jaeger's query API JSON"),
        (404, b"404 page not found\n", "is not Jaeger's query API"),
        (404, b'{"message": "no route"}', "is not Jaeger's query API"),
    ],
)
def test_a_url_that_is_not_jaegers_query_api_is_named(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: int,
    body: bytes,
    said: str,
) -> None:
    """Before: "Expecting value: line 1 column 1 (char 0)", or no traces at all for any 404."""
    _answering(monkeypatch, status, body)
    url = "http://127.0.0.1:16686/api"
    assert main(["trace", "report", "--jaeger", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url} "), err
    assert said in err
    assert "e.g. http://127.0.0.1:16686" in err  # the URL form it takes
    assert "Traceback" not in err


def test_jaegers_own_error_is_passed_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "HTTP Error 500: Internal Server Error", Jaeger's reason dropped."""
    reason = "search depth must be greater than 0 and less than max traces"
    body = json.dumps({"error": {"httpCode": 500, "message": reason}}).encode()
    _answering(monkeypatch, 500, body)
    assert main(["trace", "report", "--jaeger", "http://127.0.0.1:16686"]) == 1
    err = capsys.readouterr().err
    assert (
        err == f"error: Jaeger's query API at http://127.0.0.1:16686 answered HTTP 500: {reason}\n"
    )


JAEGER_V1 = {
    "data": [
        {
            "traceID": "a" * 32,
            "spans": [{"traceID": "a" * 32, "spanID": "b" * 16, "operationName": PREDICT}],
            "processes": {"p1": {"serviceName": "gateway"}},
        }
    ],
    "total": 0,
    "limit": 0,
    "offset": 0,
    "errors": None,
}


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (json.dumps(JAEGER_V1), "document 1 is Jaeger's own JSON (/api/traces, `data`)"),
        ("{}", "document 1 has no `resourceSpans` (keys: none)"),
        ("", "it holds no document"),
        ("\n  \n", "it holds no document"),
    ],
)
def test_a_file_without_otlp_says_what_it_expects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, said: str
) -> None:
    """Before, each read as "no traces to report on", as if it were OTLP with no spans."""
    path = tmp_path / "traces.json"
    path.write_text(content)
    assert main(["trace", "report", "--file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}"), err
    assert said in err
    assert "expected OTLP/JSON TracesData, objects with `resourceSpans`" in err
    assert "no traces to report on" not in err


def test_a_report_cut_at_the_limit_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Jaeger answers with at most --limit traces: the report read a sample of the window and
    said nothing (an observability probe: '2 of 198 traces' where 814 were answered)."""
    docs = [{"result": otlp_request(f"{i:032x}")} for i in range(1, 4)]
    _answering(monkeypatch, 200, "\n".join(json.dumps(d) for d in docs).encode())
    base = ["trace", "report", "--jaeger", "http://127.0.0.1:16686", "--since", "1m"]
    assert main([*base, "--limit", "3"]) == 0
    assert "Jaeger gave 3 traces, --limit's most" in capsys.readouterr().err
    assert main([*base, "--limit", "4"]) == 0
    assert "--limit's most" not in capsys.readouterr().err


def _serving_once(answer: bytes | None) -> str:
    """A loopback server that takes one connection and answers `answer` (None: resets it),
    as a gRPC or OTLP port does to an HTTP/1 request; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                if answer is None:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize(
    "answer",
    [
        b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00@\x00",  # an HTTP/2 SETTINGS frame
        None,  # reset, as Jaeger's OTLP gRPC port did
    ],
)
def test_a_port_that_is_not_http_is_named_not_a_traceback(
    capsys: pytest.CaptureFixture[str], answer: bytes | None
) -> None:
    """Before: http.client.BadStatusLine's traceback with the server's bytes, or a bare
    "[Errno 104] Connection reset by peer" (a tracing probe, the gateway's and Jaeger's OTLP
    ports given to --jaeger)."""
    url = _serving_once(answer)
    assert main(["trace", "report", "--jaeger", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url} did not answer as Jaeger's query API"), err
    assert "a gRPC or OTLP port?" in err
    assert "Traceback" not in err


def test_a_url_with_a_port_that_is_no_number_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "report", "--jaeger", "http://127.0.0.1:abc"]) in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("error: http://127.0.0.1:abc is not a URL: nonnumeric port"), err
