"""`hopline trace ...` commands; the analysis itself is imported only when one runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from hopline.cli.outputs import output_problems

GATEWAY_SERVICE = "gateway"
# Admin calls (GetStats, Invalidate) are traced too but say nothing about request latency.
PREDICT_OPERATION = "hopline.gateway.v1.GatewayService/Predict"
DEFAULT_SINCE_S = 600.0
DEFAULT_LIMIT = 2000


def _percentile(raw: str) -> float:
    try:
        value = float(raw.lower().removeprefix("p"))
    except ValueError:
        value = math.nan
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"a percentile like p90 or p99, got {raw!r}")
    return value


def _duration_s(raw: str) -> float:
    """`30s`, `5m`, `1h` or plain seconds; argparse's error, the flag named, for anything else."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (raw[:-1], units[raw[-1]]) if raw and raw[-1] in units else (raw, 1)
    try:
        seconds = float(number) * unit
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:  # NaN too: Jaeger's lookback must be a real span of time
        raise argparse.ArgumentTypeError(f"a duration like 30s, 5m, 1h, got {raw!r}")
    return seconds


def _trace_count(raw: str) -> int:
    """At least one trace: Jaeger answers a search depth of 0 or less with HTTP 500."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number of traces, 1 or more, got {raw!r}")
    return value


def add_trace_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tr = sub.add_parser("trace", help="tail-latency attribution from traces")
    tr_sub = tr.add_subparsers(dest="trace_command", required=True)
    rep = tr_sub.add_parser(
        "report",
        help="per hop: own time, share of the slow requests' critical path, gaps; "
        "then every hop's p50/p99 and how often it was critical",
    )
    source = rep.add_mutually_exclusive_group(required=True)
    source.add_argument("--jaeger", help="Jaeger query base URL, e.g. http://127.0.0.1:16686")
    source.add_argument("--file", type=Path, help="OTLP JSON (TracesData, one or many)")
    # The flags that only reach Jaeger default to None: given with --file, they are refused.
    rep.add_argument("--service", help=f"with --jaeger: entry service (default: {GATEWAY_SERVICE})")
    rep.add_argument(
        "--operation",
        default=PREDICT_OPERATION,
        help="only traces rooted at this RPC (default: the gateway's Predict; 'any' for all)",
    )
    rep.add_argument(
        "--since",
        type=_duration_s,
        help="with --jaeger: look back this far (s/m/h; default: 10m)",
    )
    rep.add_argument(
        "--limit",
        type=_trace_count,
        help=f"with --jaeger: most traces (1 or more; default: {DEFAULT_LIMIT})",
    )
    rep.add_argument(
        "--errors",
        choices=("exclude", "include"),
        default="exclude",
        help="failed requests (an error or non-OK gRPC code at the root): left out of the "
        "report and counted (default), or reported on with the rest",
    )
    rep.add_argument("--above", type=_percentile, default=99.0, help="e.g. p90, p99 (default)")
    rep.add_argument("--png", type=Path, help="stacked breakdown by latency band")
    rep.add_argument("--json", type=Path, help="write the report as JSON")
    rep.set_defaults(trace_handler=_report)


def _report(args: argparse.Namespace) -> int:
    from hopline.observability.report import (
        NotOtlp,
        analyse,
        fetch_jaeger,
        parse_otlp,
        plot,
        table,
    )

    problems = _jaeger_flags_with_file(args)
    problems += output_problems((args.png, "--png"), (args.json, "--json"))
    if problems:
        sys.stderr.write("".join(f"hopline trace report: error: {p}\n" for p in problems))
        return 2
    operation = None if args.operation == "any" else args.operation
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    if args.jaeger:
        service = GATEWAY_SERVICE if args.service is None else args.service
        since = DEFAULT_SINCE_S if args.since is None else args.since
        docs = fetch_jaeger(args.jaeger, service, since, limit, operation)
    else:
        docs = _read_file(args.file)
    try:
        traces = parse_otlp(docs)
    except NotOtlp as exc:
        raise NotOtlp(f"{args.file or args.jaeger}: {exc}") from exc
    if args.jaeger and len(traces) >= limit:
        # Jaeger answers with at most --limit traces, not the newest: the report then read a
        # sample of the window, unsaid (an observability probe: 198 of 8,524 requests).
        sys.stderr.write(
            f"hopline trace report: Jaeger gave {len(traces)} traces, --limit's most: the "
            f"window may hold more, which this report leaves out; raise --limit or shorten "
            "--since to read them all\n"
        )
    report = analyse(traces, args.above, operation, include_failed=args.errors == "include")
    sys.stdout.write(table(report))
    if args.png:
        plot(report, args.png)
        sys.stdout.write(f"plot  {args.png}\n")
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=1) + "\n")
        sys.stdout.write(f"json  {args.json}\n")
    return 0


def _jaeger_flags_with_file(args: argparse.Namespace) -> list[str]:
    """The flags that only reach Jaeger, given with --file: each was silently ignored (`--file
    spans.json --since 5m` reported on every trace of the file)."""
    if args.file is None:
        return []
    given = [
        flag
        for flag, value in (
            ("--service", args.service),
            ("--since", args.since),
            ("--limit", args.limit),
        )
        if value is not None
    ]
    if not given:
        return []
    verb = "go" if len(given) > 1 else "goes"
    return [f"{' and '.join(given)} {verb} with --jaeger, not --file (the whole file is read)"]


def _read_file(path: Path) -> list[Any]:
    """The JSON documents in `path`; an error that names the file."""
    from hopline.observability.report import OTLP_EXPECTED, read_json_documents

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not OTLP/JSON: not UTF-8 text ({exc.reason})") from exc
    try:
        docs = read_json_documents(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not OTLP/JSON: {exc}") from exc
    if not docs:  # else "no traces to report on", as if it held OTLP without a span
        raise ValueError(f"{path} is not OTLP/JSON: it holds no document; {OTLP_EXPECTED}")
    return docs


def run_trace_command(args: argparse.Namespace) -> int:
    try:
        return int(args.trace_handler(args))
    except BrokenPipeError:  # our reader is gone, not a file's error: hopline's main ends quietly
        raise
    except (ValueError, OSError) as exc:  # URLError is an OSError
        sys.stderr.write(f"error: {exc}\n")
        return 1
