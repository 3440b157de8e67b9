"""`hopline bench`: load a running gateway and, in the same run, the baselines it must beat.

Targets are measured one after the other, never at once (they share the cores): the bare
gRPC echo (the transport's floor), the in-process pipeline without and with the inference
service's dynamic batching, the mesh, then any peers. Each gets the same mix, the same
warm-up and the same window.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hopline.bench import hop_split
from hopline.bench.baselines import (
    compute,
    inprocess_config,
    inprocess_target,
    model_spec,
    start_echo,
    start_server,
    stop_server,
)
from hopline.bench.command import (
    DEFAULT_COMPUTE_BATCHES,
    DEFAULT_COMPUTE_ITERATIONS,
    DEFAULT_IDLE_MS,
    ECHOES,
    FRONT_DOOR,
    add_bench_command,
)
from hopline.bench.load import (
    MAX_LATENCY_GROWTH,
    Run,
)
from hopline.bench.measure import PrimeError, measure
from hopline.bench.mixes import DEFAULT_CLINC, make_mix
from hopline.bench.report import (
    model_ratios,
    ratios,
    summarise,
    table,
    window_figures,
    without_nan,
    write_png,
)
from hopline.bench.targets import (
    EchoTarget,
    PredictTarget,
    Target,
)
from hopline.cli.main import no_gateway_hint
from hopline.cli.outputs import output_problems
from hopline.gateway.client import CACHE_MODES, gateway_address
from hopline.model.repository import ModelNotFoundError
from hopline.runtime import event_loop
from hopline.runtime.api_keys import API_KEY_ENV, caller_metadata
from hopline.runtime.cpu_quota import usable_cpus
from hopline.runtime.event_loop import EventLoop
from hopline.runtime.ports import dial_problem
from hopline.runtime.server import FRONT_DOOR_MAX_STREAMS_PER_CONNECTION
from hopline.runtime.tls import channel, operator_tls

# A gateway that is up answers a health check in milliseconds; this only bounds a black hole.
MESH_PROBE_S = 3.0


class MeshUnreachable(Exception):
    """Nothing answered at the mesh's address: every window of it would be UNAVAILABLE."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.address = address


def round_robin(queue: Sequence[str], rounds: int) -> Iterator[str]:
    """The targets to measure, `rounds` times over, every other round backwards.

    On a shared machine a window's neighbours shape it (a target measured right after
    another's load runs on warm caches and a busier scheduler), so a fixed order favours one
    side of an A/B: the reversed rounds give each target each position.
    """
    for round_no in range(max(1, rounds)):
        yield from queue if round_no % 2 == 0 else reversed(queue)


def _pool(a: Run, b: Run) -> Run:
    """Two windows of one target as one: latencies pooled, durations and CPU added."""
    total = a.duration_s + b.duration_s
    return Run(
        a.latencies_ns + b.latencies_ns,
        a.statuses + b.statuses,
        a.responses + b.responses,
        total,
        a.loadgen_cpu_s + b.loadgen_cpu_s,
        (a.machine_busy * a.duration_s + b.machine_busy * b.duration_s) / total if total else 0,
        a.offered_rps,
        # A queue that built in either window is what the pooled figures include.
        max((g for g in (a.latency_growth, b.latency_growth) if g is not None), default=None),
    )


def _warn_past_streams_per_connection(args: argparse.Namespace) -> None:
    """A closed loop with more callers a connection than the gateway's port holds streams:
    the rest wait in this client's gRPC for a free stream, and that wait is measured as the
    mesh's latency."""
    per_connection = (args.concurrency or 0) / args.connections
    if per_connection > FRONT_DOOR_MAX_STREAMS_PER_CONNECTION:
        sys.stderr.write(
            f"note: {per_connection:g} callers a connection, past the "
            f"{FRONT_DOOR_MAX_STREAMS_PER_CONNECTION} streams the gateway's port holds on one: "
            "the rest wait in this client (and are timed as the mesh's); add --connections\n"
        )


def _baselines(args: argparse.Namespace) -> list[str]:
    return [b for b in args.baseline.split(",") if b and b != "none"]


def flag_problems(args: argparse.Namespace) -> list[str]:
    """Flags that cannot work together, or that nothing in this run would read (each was
    ignored unsaid, or refused with exit 1 once the bench had started): said before any
    target runs, as usage errors. Then the defaults of the flags that only some runs read."""
    problems = []
    baselines = _baselines(args)
    if "echo_idle" in baselines and args.rps:
        # Open-loop arrivals keep their own schedule: there is no caller to idle.
        problems.append(
            "--baseline echo_idle idles each caller between its calls: use --concurrency, not --rps"
        )
    elif args.idle_ms is not None and "echo_idle" not in baselines:
        problems.append("--idle-ms goes with --baseline echo_idle (the only target that idles)")
    if len([m for m in args.models.split(",") if m]) < 2:
        given = [
            flag
            for flag, value in (
                ("--compute-batches", args.compute_batches),
                ("--compute-iterations", args.compute_iterations),
            )
            if value is not None
        ]
        if given:
            verb = "go" if len(given) > 1 else "goes"
            problems.append(
                f"{' and '.join(given)} {verb} with --models naming two or more versions (the "
                "models' compute, model against model)"
            )
    if args.clinc is not None and args.mix != "clinc":
        problems.append(f"--clinc goes with --mix clinc, not --mix {args.mix}")
    elif args.mix == "clinc" and args.clinc is not None and not args.clinc.is_file():
        problems.append(f"--clinc {args.clinc}: no such file")
    elif args.mix == "clinc" and args.clinc is None and not DEFAULT_CLINC.is_file():
        problems.append(
            f"--mix clinc needs the CLINC150 data at {DEFAULT_CLINC} (../shared); give --clinc FILE"
        )
    peer_names = [p.partition("=")[0] for p in args.peer]
    twice = sorted({n for n in peer_names if peer_names.count(n) > 1})
    if twice:
        problems.append(f"--peer {', '.join(twice)} given more than once: name each peer once")
    measured = {*peer_names, *(("mesh",) if args.target != "none" else ())}
    unread = [m.partition("=")[0] for m in args.metrics if m.partition("=")[0] not in measured]
    if unread:
        problems.append(
            f"--metrics {', '.join(unread)}: no such target in this run (mesh, unless --target "
            "none, or a --peer's NAME)"
        )
    if args.target == "none" and args.api_key is not None:
        problems.append("--api-key is for the mesh's requests: not with --target none")
    if args.target == "none" and not args.peer and args.tenant:
        problems.append("--tenant is for the mesh's and peers' requests: none is measured")
    if not problems:
        if args.idle_ms is None:
            args.idle_ms = DEFAULT_IDLE_MS
        if args.compute_batches is None:
            args.compute_batches = DEFAULT_COMPUTE_BATCHES
        if args.compute_iterations is None:
            args.compute_iterations = DEFAULT_COMPUTE_ITERATIONS
    return problems


async def run_targets(args: argparse.Namespace) -> tuple[dict[str, Run], dict[str, Any]]:
    baselines = _baselines(args)
    runs: dict[str, Run] = {}
    by_round: dict[str, list[dict[str, float]]] = {}  # each round's window, in order
    describe: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    cache_mode = CACHE_MODES[args.cache]
    specs = [m for m in args.models.split(",") if m]
    # Each model-bearing target once per model (TARGET@SPEC), each model after the other.
    per_model = [f"@{spec}" for spec in specs] or [""]
    queue: list[str] = [b if b in ECHOES else b + m for b in baselines for m in per_model]
    if args.target != "none":
        queue += [f"mesh{m}" for m in per_model]
    queue += [f"peer_{p.split('=', 1)[0]}{m}" for p in args.peer for m in per_model]
    peers = dict(p.split("=", 1) for p in args.peer)
    windows = hop_split.Windows(_metrics_endpoints(args.metrics))
    # Both before any target runs: a baseline's window is minutes wasted if the run then ends.
    _check_models(args, baselines, specs)
    if args.target != "none" and not mesh_answers(gateway_address(args.target)):
        raise MeshUnreachable(gateway_address(args.target))
    _warn_past_streams_per_connection(args)
    for name in round_robin(queue, args.rounds):
        base, _, spec = name.partition("@")
        mix = make_mix(args.mix, args.clinc)
        server = None
        target: Target
        if base in ECHOES:
            server, address, loop = start_echo()
            target = EchoTarget(address, base)
            settings[name] = {"event_loop": loop}
        elif base == FRONT_DOOR:
            model_args = ["--model", spec or args.model] if spec or args.model else []
            server, address, loop = start_server(
                "hopline.bench.front_door", "--model-repo", str(args.model_repo), *model_args
            )
            target = PredictTarget(name, address, timeout_s=args.timeout)
            settings[name] = {"event_loop": loop}
        elif base.startswith("inprocess"):
            target = inprocess_target(base, args, spec)
            settings[name] = target.settings
        else:
            address = gateway_address(args.target) if base == "mesh" else peers[base[5:]]
            model, version = model_spec(spec) if spec else (args.model, "")
            target = PredictTarget(
                name,
                address,
                model=model,
                model_version=version,
                tenant=args.tenant,
                cache_mode=cache_mode,
                timeout_s=args.timeout,
                # The mesh over TLS when HOPLINE_TLS_CA is set, as `hopline predict` does.
                tls=operator_tls("gateway") if base == "mesh" else None,
                metadata=caller_metadata(args.api_key) if base == "mesh" else (),
                connections=args.connections,
            )
        try:
            sys.stderr.write(f"measuring {name} ({args.mix}) ...\n")
            pause_s = args.idle_ms / 1e3 if base == "echo_idle" else 0.0
            run = await measure(target, mix, args, pause_s, windows.at_window(base))
            windows.ended(name, base)
            runs[name] = _pool(runs[name], run) if name in runs else run
            by_round.setdefault(name, []).append(window_figures(run, target.describe))
            describe[name] = target.describe
        finally:
            await target.close()
            if server is not None:
                stop_server(server)
    records = {
        name: summarise(run, describe[name]) | {"rounds": by_round[name]}
        for name, run in runs.items()
    }
    for name, window in windows.totals.items():
        records[name]["hop_split"] = hop_split.split(window, records[name]["mean_ms"])
    result: dict[str, Any] = {"targets": records, "settings": settings}
    if len(specs) > 1 and args.compute_iterations > 0:
        result["compute"] = compute(args, specs)
    return runs, result


def _check_models(args: argparse.Namespace, baselines: Sequence[str], specs: Sequence[str]) -> None:
    """Resolve every model the baselines and --models compute load (ModelNotFoundError), so a
    misspelt one is said before the echo's window, not after it."""
    computes = len(specs) > 1 and args.compute_iterations > 0
    if computes or any(b not in ECHOES for b in baselines):
        for spec in specs or [""]:
            inprocess_config(args, spec)


def mesh_answers(address: str) -> bool:
    """Whether anything answers a health check at `address` (over TLS as the mesh's target
    dials it). Any answer counts, NOT_SERVING or a refusal too: only silence is refused."""
    with channel(address, operator_tls("gateway")) as chan:
        try:
            health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(), timeout=MESH_PROBE_S
            )
        except grpc.RpcError as err:
            silent = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return err.code() not in silent
    return True


def _metrics_endpoints(given: Sequence[str]) -> dict[str, list[str]]:
    """`--metrics mesh=H:P,H:P --metrics ray=H:P` by the target's name in the results
    (`mesh`, `peer_ray`)."""
    out: dict[str, list[str]] = {}
    for item in given:
        name, sep, endpoints = item.partition("=")
        if not sep or not endpoints:
            raise SystemExit(f"--metrics takes TARGET=HOST:PORT[,HOST:PORT...], got {item!r}")
        key = name if name == "mesh" else f"peer_{name}"
        out.setdefault(key, []).extend(e for e in endpoints.split(",") if e)
    return out


def bench_once(*argv: str) -> dict[str, Any]:
    """`hopline bench ARGV` from Python (the suite's scenarios): its results, argv and ratios."""
    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers(dest="command"))
    sys.stderr.write(f"hopline bench {' '.join(argv)}\n")
    args = parser.parse_args(["bench", *argv])
    if problems := flag_problems(args):
        raise SystemExit("; ".join(problems))
    _, result = event_loop.run(lambda: run_targets(args), EventLoop(args.loop))
    return {"argv": list(argv), **result, "ratios": ratios(result["targets"])}


def _address_problems(args: argparse.Namespace) -> list[str]:
    """The target's and peers' addresses that would dial another server or none."""
    dialled = [(peer.partition("=")[2], f"--peer {peer.partition('=')[0]}") for peer in args.peer]
    if args.target != "none":
        named_by = "--target" if args.target is not None else "HOPLINE_GATEWAY_ADDR"
        dialled.insert(0, (gateway_address(args.target), named_by))
    return [p for address, named_by in dialled if (p := dial_problem(address, named_by))]


def run_bench(args: argparse.Namespace) -> int:
    if args.concurrency is None and args.rps is None:
        args.concurrency = 1
    problems = flag_problems(args)
    problems += _address_problems(args)
    problems += output_problems((args.json, "--json"), (args.png, "--png"))
    if problems:
        sys.stderr.write("".join(f"hopline bench: error: {p}\n" for p in problems))
        return 2
    try:
        runs, result = event_loop.run(lambda: run_targets(args), EventLoop(args.loop))
    except PrimeError as exc:
        sys.stderr.write(f"error: {exc}\n")
        if exc.code == grpc.StatusCode.UNAUTHENTICATED:
            sys.stderr.write(f"(give the mesh's API key with --api-key or {API_KEY_ENV})\n")
        return 1
    except ModelNotFoundError as exc:  # a misspelt --model, --models or --model-repo
        sys.stderr.write(f"hopline bench: error: {exc} in --model-repo {args.model_repo}\n")
        return 2
    except MeshUnreachable as exc:
        sys.stderr.write(
            f"hopline bench: error: {no_gateway_hint(exc.address, '--target')} "
            "(--target none measures only the baselines)\n"
        )
        return 2
    load = f"rps {args.rps:g} (open loop)" if args.rps else f"concurrency {args.concurrency}"
    doc = {
        "hopline_bench": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cores": usable_cpus(),
        "config": {
            "target": args.target or gateway_address(None),
            "mix": args.mix,
            "concurrency": args.concurrency,
            "rps": args.rps,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "cache": args.cache,
            "model": args.model,
            "models": args.models,
            "rounds": args.rounds,
            "loop": args.loop,
        },
        **result,
        "ratios": {
            **ratios(result["targets"]),
            **model_ratios(result["targets"], result.get("compute")),
        },
    }
    sys.stdout.write(f"\nhopline bench: mix {args.mix}, {load}, {args.duration:g} s each\n")
    sys.stdout.write(table(result["targets"]) + "\n")
    for key, value in doc["ratios"].items():
        sys.stdout.write(f"  {key:<45} {value:.3f}\n")
    echoes = {n: t["mean_ms"] for n, t in result["targets"].items() if n in ECHOES}
    for name, target in result["targets"].items():
        if "hop_split" in target:
            sys.stdout.write(hop_split.split_table(name, target["hop_split"], echoes) + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # NaN (a ratio against a target that answered nothing) as null: a bare NaN is not
        # JSON, and jq and JavaScript refused the file (a reviewer's read).
        args.json.write_text(json.dumps(without_nan(doc), indent=1, allow_nan=False) + "\n")
    if args.png:
        write_png(runs, args.png, f"hopline bench: {args.mix}, {load}")
    for name, target in result["targets"].items():
        growth = target.get("latency_growth")
        if growth is not None and growth > MAX_LATENCY_GROWTH:
            sys.stderr.write(
                f"{name} did not keep up with {args.rps:g} rps: the last quarter of arrivals "
                f"waited {growth:.1f}x as long as the first (a queue built; its figures "
                "measure the queue, not the target)\n"
            )
    bad = {n: t["errors"] for n, t in result["targets"].items() if t["errors"]}
    if bad:
        sys.stderr.write(f"errors: {bad}\n")
    return 1 if any(t["requests"] == 0 for t in result["targets"].values()) else 0
