"""The `hopline bench` command line: its flags and what they mean. Kept apart from the
command's work (bench/cli.py), so that building the `hopline` parser, which every tool does,
loads neither ONNX Runtime nor the load generator.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hopline.cli.arg_types import at_least_zero, positive
from hopline.runtime.api_keys import API_KEY_ENV
from hopline.runtime.event_loop import EventLoop

BASELINES = ("echo", "echo_idle", "inprocess", "inprocess_batched", "grpc_batched")
FRONT_DOOR = "grpc_batched"
ECHOES = ("echo", "echo_idle")
DESCRIPTION = """\
Load a running hopline gateway and the baselines it must beat, one after the other, in one
run: `echo` (a bare grpc.aio echo server it starts: the transport's floor), `echo_idle` (the
same, each caller idle `--idle-ms` before each call, as a mesh's hop finds its callee at
concurrency 1: on a machine where waking a sleeping thread is dear it costs several hot
echoes; not part of the default set), `inprocess` (the
same tokenizer, model and postprocessing in this process, one request per run, in its
strongest plain thread setting) and `inprocess_batched` (the same, through the inference
service's own dynamic batcher and settings). `grpc_batched` (not part of the default set)
is that batched pipeline behind a bare grpc.aio Predict server it starts (bench/front_door.py):
the least any Python gRPC front door over the same batcher costs, so a mesh's ratio to it is
what hopline's own parts cost. Peers (`--peer ray=ADDR`) speaking hopline's
Predict are measured the same way. With `--metrics TARGET=HOST:PORT,...` (the Prometheus
endpoints of that mesh's processes) each hop is split between the gateway's time and the
server's own, and the request's between the client and the gateway's handler
(bench/hop_split.py).

How the load generator stays light on a 2-core machine: it is one process with one event
loop and one gRPC connection per target; requests are serialised before the window and sent
as raw bytes; responses are decoded after the window; latencies go into an HDR histogram
afterwards. It reports its own CPU share (`loadgen CPU`, of one core) for every target, and
how busy the machine was, so a saturated load generator is visible rather than hidden.
"""


# Defaults of the flags that only some runs read: left None by argparse, so that one given
# where nothing reads it is refused (bench/cli.py:flag_problems) instead of ignored.
DEFAULT_IDLE_MS = 10.0
DEFAULT_COMPUTE_BATCHES = (1, 32)
DEFAULT_COMPUTE_ITERATIONS = 200


def baseline_names(raw: str) -> str:
    """`--baseline`: comma-separated names, each known and once, or `none` alone. An unknown
    name ended the bench with exit 1 once it had started (an operator's probe)."""
    names = [name for name in raw.split(",") if name]
    unknown = [name for name in names if name not in (*BASELINES, "none")]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown baseline {', '.join(map(repr, unknown))}: give some of "
            f"{', '.join(BASELINES)} (comma-separated), or none"
        )
    if "none" in names and len(names) > 1:
        raise argparse.ArgumentTypeError(f"none goes alone, got {raw!r}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        # Its windows were measured twice a round and pooled, unsaid.
        raise argparse.ArgumentTypeError(f"names {', '.join(twice)} more than once")
    return raw


def batch_sizes(raw: str) -> tuple[int, ...]:
    """`--compute-batches`: comma-separated batch sizes, each a whole number from 1, once (a
    size named twice overwrote its own figures). `x` failed only once every measurement
    window had run, the run's results lost."""
    try:
        sizes = [int(size) for size in raw.split(",") if size.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"takes comma-separated batch sizes of 1 or more, like 1,32, got {raw!r}"
        )
    if len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(f"names a batch size more than once, got {raw!r}")
    return tuple(sizes)


def metrics_endpoints(raw: str) -> str:
    """`--metrics TARGET=HOST:PORT[,HOST:PORT...]` (or URLs): refused here, not once the
    bench had started (exit 1), or, for an endpoint without a port, at its target's window."""
    name, sep, endpoints = raw.partition("=")
    listed = [e for e in endpoints.split(",") if e]
    bad = [e for e in listed if "://" not in e and not _host_port(e)]
    if not (name and sep and listed) or bad:
        raise argparse.ArgumentTypeError(
            "takes TARGET=HOST:PORT[,HOST:PORT...] (TARGET: mesh, or a --peer's NAME; an "
            f"endpoint may be a URL), got {raw!r}"
        )
    return raw


def _host_port(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def peer(raw: str) -> str:
    """`--peer NAME=ADDR`: without a name the results named it `peer_`."""
    name, sep, _ = raw.partition("=")
    if not (name and sep):
        raise argparse.ArgumentTypeError(f"takes NAME=ADDR, got {raw!r}")
    return raw


def add_bench_command(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure the mesh against echo, in-process and peer baselines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        help="gateway address [env HOPLINE_GATEWAY_ADDR; default 127.0.0.1:8001]; "
        "'none' measures only the baselines",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=positive(int), help="closed loop with N callers (default 1)"
    )
    load.add_argument(
        "--rps", type=positive(float), help="open loop: Poisson arrivals at R per second"
    )
    p.add_argument(
        "--duration", type=positive(float), default=10.0, help="measured seconds per target"
    )
    p.add_argument("--warmup", type=at_least_zero, default=3.0, help="unmeasured seconds first")
    p.add_argument("--mix", default="miss", choices=("miss", "exact", "semantic", "clinc"))
    p.add_argument(
        "--clinc", type=Path, help="with --mix clinc: CLINC150 data_full.json (default: ../shared)"
    )
    p.add_argument(
        "--baseline",
        type=baseline_names,
        default="echo,inprocess,inprocess_batched",
        help="comma-separated: echo, echo_idle, inprocess, inprocess_batched, grpc_batched, "
        "or none",
    )
    p.add_argument(
        "--idle-ms",
        type=at_least_zero,
        help="with --baseline echo_idle: each caller's idle time before each call, not "
        "counted in its latency (closed loop only: refused with --rps); default "
        f"{DEFAULT_IDLE_MS:g}, about a model run on a CPU",
    )
    p.add_argument(
        "--peer",
        type=peer,
        action="append",
        default=[],
        metavar="NAME=ADDR",
        help="a peer speaking hopline.gateway.v1 Predict, reported as peer_NAME (repeatable)",
    )
    p.add_argument(
        "--metrics",
        type=metrics_endpoints,
        action="append",
        default=[],
        metavar="TARGET=HOST:PORT[,HOST:PORT...]",
        help="the Prometheus endpoints of `mesh` or a peer's processes (make run's: 8002, "
        "and 8021-8024 for services in their own process): per hop, the gateway's time "
        "against the server's own, and the time outside the gateway (bench/hop_split.py)",
    )
    p.add_argument("--model", default="", help="model to request (default: the gateway's)")
    p.add_argument(
        "--models",
        default="",
        metavar="NAME[:VERSION],...",
        help="measure the in-process, mesh and peer targets once per model version, named "
        "TARGET@NAME:VERSION (e.g. support-intents:1,support-intents:2 for FP32 vs INT8), "
        "and each model's compute alone at --compute-batches; ratios are over the first",
    )
    p.add_argument(
        "--connections",
        type=positive(int),
        default=1,
        help="gRPC connections to each mesh or peer target, calls spread over them in turn "
        "(a gateway with HOPLINE_GATEWAY_WORKERS gives each connection to one worker)",
    )
    p.add_argument(
        "--rounds",
        type=positive(int),
        default=1,
        help="measure the whole list of targets this many times in turn, pooling each "
        "target's windows; every other round runs the list backwards (A/B on a shared machine)",
    )
    p.add_argument(
        "--compute-batches",
        type=batch_sizes,
        help="with --models of two or more: comma-separated batch sizes for the models' "
        f"compute (default {','.join(map(str, DEFAULT_COMPUTE_BATCHES))})",
    )
    p.add_argument(
        "--compute-iterations",
        type=_whole_number,
        help="with --models of two or more: alternated runs per model and batch size for the "
        f"models' compute (0: skip; default {DEFAULT_COMPUTE_ITERATIONS})",
    )
    p.add_argument("--model-repo", default=os.environ.get("HOPLINE_MODEL_REPO", "models"))
    p.add_argument("--tenant", default="", help="tenant for the mesh's requests")
    p.add_argument(
        "--api-key",
        help=f"API key for the mesh's requests, for a gateway with API keys [env {API_KEY_ENV}]",
    )
    p.add_argument("--cache", default="use", choices=("use", "bypass"), help="mesh cache mode")
    p.add_argument(
        "--timeout", type=positive(float), default=30.0, help="per-request deadline, seconds"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, help="write a latency CDF per target here")
    p.add_argument(
        "--loop",
        default=EventLoop.ASYNCIO.value,
        choices=[loop.value for loop in EventLoop],
        help="the load generator's event loop (runtime/event_loop.py, as the services')",
    )


def _whole_number(raw: str) -> int:
    """0 or more: a negative count of runs skipped the compute as 0 does, unsaid."""
    value = int(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {raw}")
    return value


_whole_number.__name__ = "int"
