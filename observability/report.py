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
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

GATEWAY_SERVICE = "gateway"


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


def parse_otlp(documents: Iterable[dict[str, Any]]) -> dict[str, list[Span]]:
    """Spans by trace id from OTLP/JSON TracesData documents (or api_v3 `result` wrappers)."""
    traces: dict[str, list[Span]] = defaultdict(list)
    for doc in documents:
        data = doc.get("result", doc)
        for rs in data.get("resourceSpans", []):
            service = str(_attrs(rs.get("resource", {}).get("attributes", [])).get("service.name"))
            for ss in rs.get("scopeSpans", []) or rs.get("instrumentationLibrarySpans", []):
                for s in ss.get("spans", []):
                    kind = s.get("kind", 0)
                    span = Span(
                        trace_id=_hex_id(s["traceId"]),
                        span_id=_hex_id(s["spanId"]),
                        parent_id=_hex_id(s.get("parentSpanId", "")),
                        name=s.get("name", ""),
                        service=service,
                        kind=_KINDS.get(kind, 1) if isinstance(kind, str) else int(kind),
                        start=int(s["startTimeUnixNano"]),
                        end=int(s["endTimeUnixNano"]),
                        attributes=_attrs(s.get("attributes", [])),
                    )
                    traces[span.trace_id].append(span)
    return dict(traces)


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
            body = reply.read().decode()
    except urllib.error.HTTPError as err:
        if err.code == 404:  # api_v3 answers 404 when no trace matches
            return []
        raise
    return read_json_documents(body)


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
    gateway = [r for r in roots if r.service == GATEWAY_SERVICE and r.kind == SERVER]
    return max(gateway or roots, key=lambda r: r.end - r.start)


def critical_path(root: Span) -> dict[str, float]:
    """Milliseconds of the root's duration charged to each category; the top-level
    categories sum to the root's duration, inner spans (keys indented by two spaces) are a
    breakdown of their service's share."""
    charged: dict[str, float] = defaultdict(float)

    def charge(span: Span, ns: int) -> None:
        if ns <= 0:
            return
        if span.kind == CLIENT:
            charged[f"gap:{span.name}"] += ns / 1e6
            return
        charged[span.service] += ns / 1e6
        if span.kind != SERVER:
            charged[f"  {span.name}"] += ns / 1e6

    def walk(span: Span, until: int) -> None:
        t = min(span.end, until)
        for child in sorted(span.children, key=lambda c: c.end, reverse=True):
            if child.start >= t or child.end > span.end:
                # Began after the moment being explained, or outlived its parent
                # (fire-and-forget work such as the cache store): it delayed nothing.
                continue
            reached = min(child.end, t)
            charge(span, t - reached)
            walk(child, reached)
            t = max(child.start, span.start)
            if t <= span.start:
                break
        charge(span, t - span.start)

    walk(root, root.end)
    return dict(charged)


@dataclasses.dataclass
class Report:
    traces: int
    selected: int
    threshold_ms: float
    percentile: float
    rows: list[dict[str, Any]]
    bands: dict[str, dict[str, float]]

    def top(self) -> str:
        """The category that owns most of the slow requests' time (gaps and gateway included)."""
        rows = [r for r in self.rows if not r["name"].startswith("  ")]
        return str(max(rows, key=lambda r: r["share"])["name"]) if rows else ""


def _own_times(root: Span) -> dict[str, list[float]]:
    """Each service's server-span durations and each hop's gap (client minus server)."""
    out: dict[str, list[float]] = defaultdict(list)
    stack = [root]
    while stack:
        s = stack.pop()
        stack.extend(s.children)
        if s.kind == SERVER and s is not root:
            out[s.service].append(s.ms)
        elif s.kind == CLIENT:
            inner = [c for c in s.children if c.kind == SERVER]
            served = sum(c.ms for c in inner)
            out[f"gap:{s.name}"].append(max(0.0, s.ms - served))
        elif s.kind not in (SERVER, CLIENT) and s is not root:
            out[f"  {s.name}"].append(s.ms)
    if root.kind == SERVER:
        out[root.service].append(root.ms)
    return out


BANDS = (("p0-p50", 0, 50), ("p50-p90", 50, 90), ("p90-p99", 90, 99), ("p99-max", 99, 100))


def analyse(traces: dict[str, list[Span]], above: float, operation: str | None = None) -> Report:
    """Attribute the slow requests' time; `operation` keeps only traces rooted at that RPC."""
    roots = [r for r in (build_tree(spans) for spans in traces.values()) if r is not None]
    if operation:
        roots = [r for r in roots if r.name == operation]
    if not roots:
        raise ValueError(
            "no traces to report on" + (f" with root operation {operation!r}" if operation else "")
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
    return Report(len(roots), len(slow), threshold, above, rows, bands)


def table(report: Report) -> str:
    lines = [
        f"{report.selected} of {report.traces} traces at or above p{report.percentile:g} "
        f"({report.threshold_ms:.2f} ms end to end)",
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
