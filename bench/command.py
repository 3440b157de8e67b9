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
    p.add_argument("--clinc", type=Path, help="CLINC150 data_full.json (default: ../shared)")
    p.add_argument(
        "--baseline",
        default="echo,inprocess,inprocess_batched",
        help="comma-separated: echo, echo_idle, inprocess, inprocess_batched, grpc_batched, "
        "or none",
    )
    p.add_argument(
        "--idle-ms",
        type=at_least_zero,
        default=10.0,
        help="echo_idle: each caller's idle time before each call, not counted in its latency "
        "(closed loop only: refused with --rps); default about a model run on a CPU",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=ADDR",
        help="a peer speaking hopline.gateway.v1 Predict, reported as peer_NAME (repeatable)",
    )
    p.add_argument(
        "--metrics",
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
    p.add_argument("--compute-batches", default="1,32", help="batch sizes for --models compute")
    p.add_argument(
        "--compute-iterations",
        type=int,
        default=200,
        help="alternated runs per model and batch size for --models compute (0: skip)",
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
