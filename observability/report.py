"""`hopline trace report`: which hop owns the tail, from Jaeger's api_v3 or an OTLP JSON file.

For each trace the critical path is walked back from the root's end: at every moment the
reply was waiting on exactly one span, the last-finishing child of whatever was running, so
concurrent work (tokenization beside the cache lookup) is charged only where it delayed the
reply. The path's time is attributed to:

- a service (`tokenizer`, `cache`, `inference`, `postprocess`): time inside its server span
  and the spans under it, with inner spans (`inference.queue`, `cache.search`, ...) split out
  in the detail table;
- `gateway`: the gateway's own time outside any upstream call;
- `gap:<hop>`: time inside the gateway's client span for a hop but outside that hop's server
  span — network, serialisation, HTTP/2 flow control and channel-pool wait, which the serving
  systems' own metrics never show.

Beside that, `hop_table` lists every hop span over all the analysed traces, whether or not it
ever held the critical path: the gateway's client span per hop, the service's server span
under it and their inner spans, each with its p50/p99 and the share of its own time it spent
on the critical path (the tokenizer, beside the slower cache lookup, at 0%).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hopline.observability.trace_cli import GATEWAY_SERVICE


@dataclasses.dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    kind: int
    start: int  # ns
    end: int  # ns
    attributes: dict[str, Any]
    children: list[Span] = dataclasses.field(default_factory=list)
    links: tuple[str, ...] = ()  # the span ids this span links to
    error: bool = False  # its status is ERROR
    process: str = ""  # its resource's service.name (`service`: whom it is charged to)

    @property
    def failed(self) -> bool:
        """An error status, or a gRPC code other than OK: a caller's mistake answered at once
        (INVALID_ARGUMENT, a refusal) is no success's latency either, though not an error.
        DEADLINE_EXCEEDED is not: a request that ran out of time is the tail itself."""
        code = self.attributes.get("rpc.grpc.status_code", 0)
        if code == DEADLINE_EXCEEDED:
            return False
        return self.error or code not in (0, None)

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e6


# OTLP span kinds (the JSON encoding uses the enum's integer or its name).
SERVER, CLIENT = 2, 3
_KINDS = {
    "SPAN_KIND_INTERNAL": 1,
    "SPAN_KIND_SERVER": SERVER,
    "SPAN_KIND_CLIENT": CLIENT,
    "SPAN_KIND_PRODUCER": 4,
    "SPAN_KIND_CONSUMER": 5,
}
_KIND_NAMES = {SERVER: "server", CLIENT: "client", 4: "producer", 5: "consumer"}
STATUS_ERROR = 2  # OTLP's STATUS_CODE_ERROR
DEADLINE_EXCEEDED = 4  # gRPC's code, as rpc.grpc.status_code carries it


def _is_error(status: Any) -> bool:
    code = status.get("code", 0) if isinstance(status, dict) else 0
    return code in (STATUS_ERROR, "STATUS_CODE_ERROR")


def _value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "intValue", "doubleValue", "boolValue"):
        if key in v:
            return int(v[key]) if key == "intValue" else v[key]
    return None


def _attrs(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items}


def _hex_id(raw: str) -> str:
    """OTLP/JSON ids are hex; some exporters write base64 (the protobuf JSON mapping)."""
    if not raw:
        return ""
    try:
        int(raw, 16)
        return raw.lower()
    except ValueError:
        import base64

        return base64.b64decode(raw).hex()


class NotOtlp(ValueError):
    """A document that is not OTLP/JSON TracesData (nor api_v3's wrapper of it)."""


# What --file takes, said whenever a file is not it.
OTLP_EXPECTED = (
    "expected OTLP/JSON TracesData, objects with `resourceSpans` (one, an array or JSON "
    "lines), as Jaeger's /api/v3/traces or a collector's file exporter writes"
)


def parse_otlp(documents: Iterable[Any]) -> dict[str, list[Span]]:
    """Spans by trace id from OTLP/JSON TracesData documents (or api_v3 `result` wrappers);
    NotOtlp names the first document that is not one and what it lacks."""
    traces: dict[str, list[Span]] = defaultdict(list)
    for number, doc in enumerate(documents, 1):
        _check_document(number, doc)
        try:
            spans = list(_document_spans(doc))
        except KeyError as exc:
            raise NotOtlp(f"document {number} is not OTLP/JSON: a span has no {exc}") from exc
        except (AttributeError, TypeError, ValueError) as exc:
            raise NotOtlp(f"document {number} is not OTLP/JSON TracesData ({exc})") from exc
        for span in spans:
            traces[span.trace_id].append(span)
    return dict(traces)


def _check_document(number: int, doc: Any) -> None:
    """NotOtlp for a JSON object that is no TracesData: such a document gave no spans, and
    the report said "no traces to report on", as if the file held none. An api_v3 `result`
    may lack `resourceSpans` (protobuf's JSON leaves an empty list out); a bare document
    may not, so `{}` is refused too."""
    if not isinstance(doc, dict) or "resourceSpans" in doc or isinstance(doc.get("result"), dict):
        return  # not an object: _document_spans says what is wrong with it
    if isinstance(doc.get("data"), list):
        raise NotOtlp(
            f"document {number} is Jaeger's own JSON (/api/traces, `data`), not OTLP/JSON; "
            f"{OTLP_EXPECTED}"
        )
    keys = ", ".join(sorted(map(str, doc))[:5]) or "none"
    raise NotOtlp(f"document {number} has no `resourceSpans` (keys: {keys}); {OTLP_EXPECTED}")


def _document_spans(doc: dict[str, Any]) -> Iterator[Span]:
    data = doc.get("result", doc)
    for rs in data.get("resourceSpans", []):
        service = str(_attrs(rs.get("resource", {}).get("attributes", [])).get("service.name"))
        for ss in rs.get("scopeSpans", []) or rs.get("instrumentationLibrarySpans", []):
            for s in ss.get("spans", []):
                kind = s.get("kind", 0)
                kind = _KINDS.get(kind, 1) if isinstance(kind, str) else int(kind)
                attributes = _attrs(s.get("attributes", []))
                yield Span(
                    trace_id=_hex_id(s["traceId"]),
                    span_id=_hex_id(s["spanId"]),
                    parent_id=_hex_id(s.get("parentSpanId", "")),
                    name=str(s.get("name", "")),
                    service=_serving(service, kind, attributes),
                    process=service,
                    kind=kind,
                    start=int(s["startTimeUnixNano"]),
                    end=int(s["endTimeUnixNano"]),
                    attributes=attributes,
                    links=tuple(_hex_id(link["spanId"]) for link in s.get("links", []) or []),
                    error=_is_error(s.get("status")),
                )


def _serving(process: str, kind: int, attributes: Mapping[str, Any]) -> str:
    """The service a span is charged to: its process's, but for the server span of a
    hopline service run inside another process (a co-located gateway's tokenizer, inference
    and postprocess), that service's, from its `rpc.service` (`hopline.<name>.v1.*`). The
    process's name put every stage's time in the gateway's row (an observability probe:
    `gateway 800` server spans for 200 traces, 99.7% of the tail)."""
    if kind != SERVER:
        return process
    package = str(attributes.get("rpc.service", "")).split(".")
    if len(package) == 4 and package[0] == "hopline" and package[2] == "v1":
        return package[1]
    return process


def read_json_documents(text: str) -> list[dict[str, Any]]:
    """One JSON document, a JSON array, JSON lines, or concatenated objects (api_v3 streams)."""
    decoder = json.JSONDecoder()
    docs: list[dict[str, Any]] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            break
        obj, i = decoder.raw_decode(text, i)
        docs.extend(obj if isinstance(obj, list) else [obj])
    return docs


def fetch_jaeger(
    base: str, service: str, since_s: float, limit: int = 1000, operation: str | None = None
) -> list[dict[str, Any]]:
    """Traces through `service` (and `operation`) in the last `since_s` s, from api_v3."""
    now = time.time()

    def rfc3339(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"

    query = urllib.parse.urlencode(
        {
            "query.service_name": service,
            "query.start_time_min": rfc3339(now - since_s),
            "query.start_time_max": rfc3339(now + 1),
            "query.search_depth": str(limit),
            "query.num_traces": str(limit),
        }
        | ({"query.operation_name": operation} if operation else {})
    )
    url = f"{base.rstrip('/')}/api/v3/traces?{query}"
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            body = reply.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        said = _jaeger_error(err.read().decode("utf-8", "replace"))
        if said is None:
            raise ValueError(
                f"{base} is not Jaeger's query API: {url.partition('?')[0]} answered HTTP "
                f"{err.code} without Jaeger's JSON error; {JAEGER_EXPECTED}"
            ) from err
        if err.code == 404 and "found" in said.lower():  # api_v3's "No traces found"
            return []
        raise ValueError(f"Jaeger's query API at {base} answered HTTP {err.code}: {said}") from err
    except urllib.error.URLError as err:  # nothing answered there at all
        raise OSError(
            f"cannot reach Jaeger's query API at {base}: {err.reason} (`make jaeger` starts "
            "one on this machine; --jaeger takes its query address, port 16686 by default)"
        ) from err
    except http.client.InvalidURL as err:
        raise ValueError(f"{base} is not a URL: {err}; {JAEGER_EXPECTED}") from err
    except (http.client.HTTPException, ConnectionError) as err:
        # A server that is not HTTP/1 at all (a gRPC port, Jaeger's own OTLP port 4317 given
        # for its query port): a traceback with its bytes, or a bare socket error, before.
        raise ValueError(
            f"{base} did not answer as Jaeger's query API (an HTTP/1 server): "
            f"{type(err).__name__}: {str(err)[:80]} (a gRPC or OTLP port? {JAEGER_EXPECTED})"
        ) from err
    try:
        docs: list[Any] = read_json_documents(body)
    except ValueError:
        docs = [None]
    # api_v3 streams its traces as `{"result": TracesData}` objects; anything else (a web
    # page, another API's JSON) is some other server's answer to that path.
    if not all(isinstance(d, dict) and isinstance(d.get("result"), dict) for d in docs):
        raise ValueError(
            f"{base} did not answer with Jaeger's query API JSON: {url.partition('?')[0]} "
            f"gave {body[:40]!r}; {JAEGER_EXPECTED}"
        )
    return docs


# Said wherever --jaeger's URL turns out to be something else.
JAEGER_EXPECTED = (
    "--jaeger takes the base URL of Jaeger's query service, scheme, host and port with no "
    "path, e.g. http://127.0.0.1:16686 (hopline reads <URL>/api/v3/traces)"
)


def _jaeger_error(body: str) -> str | None:
    """The message of Jaeger's JSON error (`{"error": {"httpCode": 404, "message": ...}}`,
    from api_v3's HTTP gateway), or None for a body that is not one: another server's page."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or "message" not in error:
        return None
    return str(error["message"])


def build_tree(spans: Sequence[Span]) -> Span | None:
    """Link parents and children; the root is the gateway's server span (or any root)."""
    by_id = {s.span_id: s for s in spans}
    roots = []
    for s in spans:
        s.children = []
    for s in spans:
        parent = by_id.get(s.parent_id)
        if parent is None:
            roots.append(s)
        else:
            parent.children.append(s)
    if not roots:
        return None
    _inherit_service(roots)
    gateway = [r for r in roots if r.service == GATEWAY_SERVICE and r.kind == SERVER]
    return max(gateway or roots, key=lambda r: r.end - r.start)


def _inherit_service(roots: Sequence[Span]) -> None:
    """A service's own inner spans (inference.run under a co-located Infer) are charged to
    it, not to the process it ran in (`_serving`)."""
    stack = list(roots)
    while stack:
        span = stack.pop()
        for child in span.children:
            if child.kind not in (SERVER, CLIENT) and child.process == span.process:
                child.service = span.service
            stack.append(child)


# The gateway's stage batch (gateway/stage_batching.py): one RPC for several requests' rows,
# under the first recorded request's hop span and linked from every request's.
STAGE_BATCH = "gateway.stage_batch"


def join_batches(roots: Sequence[Span]) -> None:
    """Hangs each stage batch's server span, wherever the batch was recorded (in another
    request's trace), under every hop span it served that has none of its own, so each
    request's hop reads as client -> server as an unbatched one does: without this, the
    service's whole time read as the hop's gap (network) in every request but the first."""
    batches: dict[str, Span] = {}
    stack = list(roots)
    while stack:
        span = stack.pop()
        stack.extend(span.children)
        if span.name == STAGE_BATCH:
            for linked in span.links:
                batches[linked] = span
    stack = list(roots)
    while stack:
        span = stack.pop()
        stack.extend(span.children)
        batch = batches.get(span.span_id)
        if span.kind != CLIENT or batch is None or _served_under(span):
            continue
        span.children.extend(c for c in batch.children if c.kind == SERVER)


def _served_under(client: Span) -> bool:
    """Whether a hop span has its server span under it, directly or through its batch."""
    return any(
        c.kind == SERVER or (c.name == STAGE_BATCH and any(g.kind == SERVER for g in c.children))
        for c in client.children
    )


CUT_SLACK_NS = 2_000_000  # see _walk_critical: at least 2 ms, or 1% of the parent


def _walk_critical(root: Span) -> tuple[dict[str, float], dict[int, int]]:
    """The critical path's milliseconds by category (see `critical_path`), and per span
    (keyed by `id(span)`) the nanoseconds the path spent inside it or the spans under it."""
    charged: dict[str, float] = defaultdict(float)
    inside: dict[int, int] = {}

    def charge(span: Span, ns: int) -> None:
        if ns <= 0:
            return
        if span.kind == CLIENT:
            charged[f"gap:{span.name}"] += ns / 1e6
            return
        if span.name == STAGE_BATCH:  # the batch RPC's time outside its server: the hop's
            charged[f"gap:{span.attributes.get('hopline.hop', span.name)}"] += ns / 1e6
            return
        charged[span.service] += ns / 1e6
        if span.kind != SERVER:
            charged[f"  {span.name}"] += ns / 1e6

    def walk(span: Span, until: int) -> None:
        t = min(span.end, until)
        inside[id(span)] = inside.get(id(span), 0) + max(0, t - span.start)
        # A child ending this little after its parent was cut with it (the client's deadline
        # ended the request and, a moment later, the hop it was waiting for): it held the
        # parent to its end. Past it, the child outlived its parent (fire-and-forget work
        # such as the cache store) and delayed nothing.
        cut_with_parent = span.end + max(CUT_SLACK_NS, (span.end - span.start) // 100)
        for child in sorted(span.children, key=lambda c: c.end, reverse=True):
            if child.start >= t or child.end > cut_with_parent:
                continue  # began after the moment being explained, or fire-and-forget
            reached = min(child.end, t)
            charge(span, t - reached)
            walk(child, reached)
            t = max(child.start, span.start)
            if t <= span.start:
                break
        charge(span, t - span.start)

    walk(root, root.end)
    return dict(charged), inside


def critical_path(root: Span) -> dict[str, float]:
    """Milliseconds of the root's duration charged to each category; the top-level
    categories sum to the root's duration, inner spans (keys indented by two spaces) are a
    breakdown of their service's share."""
    return _walk_critical(root)[0]


def _hop_key(span: Span, parents: Sequence[Span]) -> tuple[str, ...]:
    """A span's row in the hop table: labels from its enclosing hop (the outermost client
    span: a batch's own call under a request's hop, as the store queue makes, is a row
    under that hop, not the hop again) down to it, a client span by its name, a server span
    by its service, others by their name. A span under no hop (e.g.
    `gateway.stream_message`) starts from the root's children."""
    chain = [*parents, span]
    start = min((i for i, s in enumerate(chain) if s.kind == CLIENT), default=0)
    # What a stage batch carried reads as the hop's own (its server a row under the hop, as
    # for an unbatched request); the batch span itself keeps a row.
    chain = [s for s in chain[start:-1] if s.name != STAGE_BATCH] + [span]
    return tuple(s.service if s.kind == SERVER else s.name for s in chain)


def hop_table(roots: Sequence[Span]) -> list[dict[str, Any]]:
    """Every span under the roots, grouped by hop, whether or not it held the critical path:
    per row its count, p50/p99 duration, mean time on the critical path per occurrence and
    that time's share of its own (0 for work beside a slower sibling or outliving the reply).
    Rows come hop by hop (in order of their mean start in the request), each hop's client
    span first, then the spans under it; `depth` is the row's nesting under its hop."""
    own: dict[tuple[str, ...], list[int]] = defaultdict(list)
    on_path: dict[tuple[str, ...], int] = defaultdict(int)
    offset: dict[tuple[str, ...], list[int]] = defaultdict(list)
    kind: dict[tuple[str, ...], int] = {}
    service: dict[tuple[str, ...], str] = {}
    for root in roots:
        inside = _walk_critical(root)[1]
        stack: list[tuple[Span, tuple[Span, ...]]] = [(c, ()) for c in root.children]
        while stack:
            span, parents = stack.pop()
            stack.extend((c, (*parents, span)) for c in span.children)
            key = _hop_key(span, parents)
            own[key].append(span.end - span.start)
            on_path[key] += inside.get(id(span), 0)
            offset[key].append(span.start - root.start)
            kind.setdefault(key, span.kind)
            service.setdefault(key, span.service)

    def order(key: tuple[str, ...]) -> tuple[tuple[float, str], ...]:
        # Each level of the path by its mean start, so a hop's rows stay together.
        return tuple((float(np.mean(offset[key[:i]])), key[i - 1]) for i in range(1, len(key) + 1))

    rows = []
    for key in sorted(own, key=order):
        ms = np.array(own[key]) / 1e6
        total = float(ms.sum())
        rows.append(
            {
                "name": key[-1],
                "hop": key[0],
                "path": list(key),
                "depth": len(key) - 1,
                "kind": _KIND_NAMES.get(kind[key], "internal"),
                "service": service[key],
                "count": len(ms),
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
                "critical_ms": on_path[key] / 1e6 / len(ms),
                "critical": on_path[key] / 1e6 / total if total else 0.0,
            }
        )
    return rows


@dataclasses.dataclass
class Report:
    traces: int
    selected: int
    threshold_ms: float
    percentile: float
    rows: list[dict[str, Any]]
    bands: dict[str, dict[str, float]]
    # Every hop span over all `traces`, critical or not (see `hop_table`).
    hops: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Failed requests left out of `traces` (analyse's include_failed keeps them in).
    failed: int = 0

    def top(self) -> str:
        """The category that owns most of the slow requests' time (gaps and gateway included)."""
        rows = [r for r in self.rows if not r["name"].startswith("  ")]
        return str(max(rows, key=lambda r: r["share"])["name"]) if rows else ""


def _own_times(root: Span) -> dict[str, list[float]]:
    """Each service's server-span durations and each hop's gap (client minus server, the
    server reached through its stage batch where it went in one), over the work that ended
    before the reply (a store after it is no part of the request's time). The root's row is
    its own time: its duration less its children's that ended before it did."""
    out: dict[str, list[float]] = defaultdict(list)
    stack = [c for c in root.children if c.end <= root.end]
    while stack:
        s = stack.pop()
        stack.extend(s.children)
        if s.kind == SERVER:
            out[s.service].append(s.ms)
        elif s.kind == CLIENT:
            inner = [c for c in s.children if c.kind == SERVER] or [
                g
                for c in s.children
                if c.name == STAGE_BATCH
                for g in c.children
                if g.kind == SERVER
            ]
            served = sum(c.ms for c in inner)
            out[f"gap:{s.name}"].append(max(0.0, s.ms - served))
        elif s.name != STAGE_BATCH:
            out[f"  {s.name}"].append(s.ms)
    if root.kind == SERVER:
        out[root.service].append(_walk_critical(root)[0].get(root.service, 0.0))
    return out


BANDS = (("p0-p50", 0, 50), ("p50-p90", 50, 90), ("p90-p99", 90, 99), ("p99-max", 99, 100))


def analyse(
    traces: dict[str, list[Span]],
    above: float,
    operation: str | None = None,
    include_failed: bool = False,
) -> Report:
    """Attribute the slow requests' time; `operation` keeps only traces rooted at that RPC.

    Requests that failed (`Span.failed` at the root) are left out unless `include_failed`:
    with a hop down, each failed call's connection attempts read as that hop's gap, as if
    the network were slow for the requests that were answered."""
    roots = [r for r in (build_tree(spans) for spans in traces.values()) if r is not None]
    join_batches(roots)
    if operation:
        roots = [r for r in roots if r.name == operation]
    failed = 0
    if not include_failed:
        answered = [r for r in roots if not r.failed]
        failed, roots = len(roots) - len(answered), answered
    if not roots:
        raise ValueError(
            "no traces to report on"
            + (f" with root operation {operation!r}" if operation else "")
            + (f": all {failed} failed (--errors include reports on them)" if failed else "")
        )
    e2e = np.array([r.ms for r in roots])
    threshold = float(np.percentile(e2e, above))
    slow = [r for r in roots if r.ms >= threshold]
    total = sum(r.ms for r in slow)
    charged: dict[str, float] = defaultdict(float)
    own: dict[str, list[float]] = defaultdict(list)
    for r in slow:
        for k, v in critical_path(r).items():
            charged[k] += v
        for k, vals in _own_times(r).items():
            own[k].extend(vals)
    rows = []
    for name in sorted(charged, key=lambda k: (k.startswith("  "), -charged[k])):
        vals = own.get(name, [])
        rows.append(
            {
                "name": name,
                "count": len(vals),
                "p50_ms": float(np.percentile(vals, 50)) if vals else 0.0,
                "p99_ms": float(np.percentile(vals, 99)) if vals else 0.0,
                "critical_ms": charged[name] / len(slow),
                "share": charged[name] / total if total else 0.0,
            }
        )
    bands: dict[str, dict[str, float]] = {}
    for label, lo, hi in BANDS:
        a, b = np.percentile(e2e, lo), np.percentile(e2e, hi)
        members = [r for r in roots if a <= r.ms <= b]
        sums: dict[str, float] = defaultdict(float)
        for r in members:
            for k, v in critical_path(r).items():
                if not k.startswith("  "):
                    sums[k] += v / len(members)
        bands[label] = dict(sums)
    return Report(len(roots), len(slow), threshold, above, rows, bands, hop_table(roots), failed)


def table(report: Report) -> str:
    lines = [
        f"{report.selected} of {report.traces} traces at or above p{report.percentile:g} "
        f"({report.threshold_ms:.2f} ms end to end)",
    ]
    if report.failed:
        lines.append(
            f"{report.failed} failed requests left out (--errors include reports on them too)"
        )
    lines += [
        "",
        f"{'hop':<28}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}{'critical ms':>13}{'share':>8}",
    ]
    for row in report.rows:
        lines.append(
            f"{row['name']:<28}{row['count']:>7}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}"
            f"{row['critical_ms']:>13.2f}{row['share']:>8.1%}"
        )
    lines.append("")
    lines.append(
        "critical ms: mean time per slow request on the reply's critical path; gap:HOP is "
        "network + serialisation + pool wait around that hop"
    )
    if report.hops:
        lines += [
            "",
            f"every hop over all {report.traces} traces",
            "",
            f"{'hop':<28}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}{'critical ms':>13}"
            f"{'critical':>10}",
        ]
        for hop in report.hops:
            name = "  " * hop["depth"] + hop["name"]
            lines.append(
                f"{name:<28}{hop['count']:>7}{hop['p50_ms']:>10.2f}{hop['p99_ms']:>10.2f}"
                f"{hop['critical_ms']:>13.2f}{hop['critical']:>10.1%}"
            )
        lines.append("")
        lines.append(
            "critical ms: mean time per span on its request's critical path; critical: that "
            "time's share of the span's own (0% ran beside slower work or after the reply)"
        )
    return "\n".join(lines) + "\n"


def plot(report: Report, path: Path) -> None:
    """Stacked mean critical-path time per category, per percentile band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cats = sorted({k for b in report.bands.values() for k in b})
    labels = list(report.bands)
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bottom = np.zeros(len(labels))
    for cat in cats:
        heights = np.array([report.bands[b].get(cat, 0.0) for b in labels])
        ax.bar(labels, heights, bottom=bottom, label=cat)
        bottom += heights
    ax.set_ylabel("mean critical-path time (ms)")
    ax.set_xlabel("end-to-end latency band")
    ax.set_title(f"Where the time goes, by latency band ({report.traces} traces)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
