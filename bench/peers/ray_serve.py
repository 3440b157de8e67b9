"""hopline's pipeline served the way a Ray Serve user would serve it: the benchmark's peer.

Four deployments composed with DeploymentHandles (Ingress -> Tokenizer -> Model ->
Postprocess), the Model batching with Ray's own `@serve.batch`, behind Ray Serve's gRPC proxy
speaking hopline's GatewayService, so the same load generator drives both. The tokenizer,
ONNX session and postprocessing are hopline's own code: only the serving differs.

Usage: .venv/bin/python bench/peers/ray_serve.py --grpc-port PORT [--model-repo models]
    [--model support-intents] [--model-threads 0] [--max-batch-size 32] [--batch-wait-ms 2]

Prints `READY 127.0.0.1:PORT` once a real Predict has answered through the proxy, then serves
until SIGTERM or SIGINT. See bench/peers/README.md for the choices made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import grpc
import numpy as np
import numpy.typing as npt

from hopline.model.repository import ModelConfig, ModelRepository
from hopline.model.session import make_session
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.services.postprocess.logic import predictions

# Ray reads these when its processes start, so they must be set before `import ray`
# spawns anything; workers inherit the driver's environment.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Serve's gRPC proxy binds [::]:PORT with SO_REUSEPORT by default, and so does every grpcio
# server: a port already held by a hopline gateway would be shared silently and the load
# split between the two. Without it, a taken port fails the bind instead.
os.environ.setdefault("SERVE_SOCKET_REUSE_PORT_ENABLED", "0")
# Ray starts every worker (the proxy and the replicas) at nice 15 so that its own daemons win
# on a saturated node. On a benchmark box shared with the load generator and hopline, both at
# nice 0, that would measure the scheduler, not Serve.
os.environ.setdefault("RAY_worker_niceness", "0")

import ray
from ray import serve
from ray.serve import Deployment
from ray.serve.config import HTTPOptions, gRPCOptions
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ApplicationStatus, LoggingConfig

APP_NAME = "hopline-peer"
SERVICER = "hopline.protos.hopline.gateway.v1.gateway_pb2_grpc.add_GatewayServiceServicer_to_server"
PROBE_TEXT = "I forgot my password"
# The graceful shutdown Serve gives each replica; its default (20 s) only delays exit here,
# since nothing long-running is in flight when the harness stops the peer.
GRACEFUL_SHUTDOWN_S = 3.0
# Serve's default max_ongoing_requests is 5 per replica: with one replica of each deployment
# that caps the whole pipeline at 5 requests in flight and every batch at 5. Ray's batching
# guide asks for max_ongoing_requests >= max_batch_size; the hops around the model must admit
# at least as many, or they become the cap.
MIN_ONGOING = 256
# Each actor claims a quarter CPU of the 2 Ray is told about, so all four replicas schedule
# on a 2-core box; the claim is bookkeeping only, the processes use what the OS gives them.
ACTOR_CPUS = 0.25

_Handler = Callable[[int, FrameType | None], None]

LOGGING = LoggingConfig(log_level="WARNING", enable_access_log=False)


def _config(repo: str, name: str) -> ModelConfig:
    return ModelRepository(Path(repo)).resolve(name)


def _deployment(cls: type, max_ongoing_requests: int = MIN_ONGOING) -> Deployment:
    """One replica of `cls`, named after it, with the settings every hop shares."""
    return serve.deployment(
        num_replicas=1,
        ray_actor_options={"num_cpus": ACTOR_CPUS},
        max_ongoing_requests=max_ongoing_requests,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        logging_config=LOGGING,
    )(cls)


class Tokenizer:
    def __init__(self, repo: str, name: str) -> None:
        cfg = _config(repo, name)
        self._tokenizer = load_tokenizer(cfg.file("tokenizer"), cfg.max_sequence_length)

    async def encode(self, text: str) -> npt.NDArray[np.int64]:
        # One text encodes unpadded; the Model pads the rows of the batch it forms.
        ids: npt.NDArray[np.int64] = encode(self._tokenizer, [text]).input_ids[0]
        return ids


class Model:
    def __init__(
        self, repo: str, name: str, threads: int, max_batch_size: int, batch_wait_s: float
    ) -> None:
        cfg = _config(repo, name)
        self._session = make_session(cfg.file("model"), threads=threads, providers=cfg.providers)
        # The decorator's arguments are fixed at import; the flags apply per instance.
        # (Ray types the decorated method as a plain callable, without these setters.)
        self.infer.set_max_batch_size(max_batch_size)  # type: ignore[attr-defined]
        self.infer.set_batch_wait_timeout_s(batch_wait_s)  # type: ignore[attr-defined]
        self._batch_sizes: Counter[int] = Counter()
        # ONNX Runtime allocates and picks kernels on the first runs; do it before READY,
        # as hopline's inference service warms up before it reports SERVING.
        for rows in (1, max_batch_size):
            ids = np.full((rows, 16), 101, dtype=np.int64)
            self._run(ids, np.ones_like(ids))

    def _run(
        self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float32]:
        (logits,) = self._session.run(["logits"], {"input_ids": ids, "attention_mask": mask})
        out: npt.NDArray[np.float32] = logits
        return out

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def infer(self, rows: list[npt.NDArray[np.int64]]) -> list[npt.NDArray[np.float32]]:
        self._batch_sizes[len(rows)] += 1
        # Right padding with pad id 0 and mask 0: what encode() does for texts tokenized
        # together, so a row's answer does not depend on its batch-mates.
        longest = max(len(r) for r in rows)
        ids = np.zeros((len(rows), longest), dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        # Off the replica's event loop (ONNX Runtime releases the GIL), so requests that
        # arrive during a run still reach the batch queue and form the next batch.
        logits = await asyncio.to_thread(self._run, ids, mask)
        return list(logits)

    async def stats(self) -> dict[str, int]:
        counters = {f"batch_size_{size}": n for size, n in sorted(self._batch_sizes.items())}
        counters["model_batches"] = sum(self._batch_sizes.values())
        counters["model_rows"] = sum(size * n for size, n in self._batch_sizes.items())
        return counters


class Postprocess:
    def __init__(self, repo: str, name: str) -> None:
        cfg = _config(repo, name)
        self._labels = cfg.labels
        self._threshold = cfg.oos_threshold

    async def run(self, logits: npt.NDArray[np.float32], top_k: int) -> common_pb2.Prediction:
        (prediction,) = predictions(logits[None, :], None, self._labels, self._threshold, top_k)
        return prediction


class Ingress:
    """GatewayService's Predict and GetStats, as Serve's gRPC proxy calls them by name."""

    def __init__(
        self,
        repo: str,
        name: str,
        tokenizer: DeploymentHandle[Any],
        model: DeploymentHandle[Any],
        postprocess: DeploymentHandle[Any],
    ) -> None:
        cfg = _config(repo, name)
        self._name = cfg.name
        self._version = cfg.version
        self._num_labels = len(cfg.labels)
        self._tokenizer = tokenizer
        self._model = model
        self._postprocess = postprocess
        self._counters: Counter[str] = Counter()

    def _reject(
        self, context: RayServegRPCContext, code: grpc.StatusCode, message: str
    ) -> gateway_pb2.PredictResponse:
        # Serve has no abort(): a code set on its context, with an empty reply returned, is
        # what the proxy sends (raising instead would log a stack trace per bad request).
        self._counters[code.name.lower()] += 1
        context.set_code(code)
        context.set_details(message)
        return gateway_pb2.PredictResponse()

    async def Predict(
        self, request: gateway_pb2.PredictRequest, grpc_context: RayServegRPCContext
    ) -> gateway_pb2.PredictResponse:
        started = time.perf_counter()
        self._counters["requests"] += 1
        # The same checks and codes as hopline's gateway, so errors compare like for like.
        if not request.text.strip():
            return self._reject(
                grpc_context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "text is empty: put the text to classify in PredictRequest.text",
            )
        if (request.model and request.model != self._name) or (
            request.model_version and request.model_version != self._version
        ):
            wanted = f"{request.model or self._name}/{request.model_version or 'latest'}"
            return self._reject(
                grpc_context,
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {wanted!r} (serving: {self._name}/{self._version})",
            )
        top_k = request.top_k or 1
        if not 1 <= top_k <= self._num_labels:
            return self._reject(
                grpc_context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"top_k must be 1 to {self._num_labels} for {self._name}, got {request.top_k}",
            )
        # Responses passed straight into the next call, as Serve's composition guide does:
        # the ingress waits once, for the end of the chain.
        ids = self._tokenizer.encode.remote(request.text)
        logits = self._model.infer.remote(ids)
        prediction: common_pb2.Prediction = await self._postprocess.run.remote(logits, top_k)
        response = gateway_pb2.PredictResponse(
            prediction=prediction,
            model=self._name,
            model_version=self._version,
            tenant=request.tenant or "default",
            cache=gateway_pb2.CacheInfo(
                outcome=common_pb2.CACHE_OUTCOME_SKIPPED, detail="the Ray Serve peer has no cache"
            ),
        )
        response.timings.add(hop="total", ms=(time.perf_counter() - started) * 1000.0)
        return response

    async def GetStats(self, request: gateway_pb2.GetStatsRequest) -> gateway_pb2.GetStatsResponse:
        # Batch sizes come from here, so a benchmark can see what @serve.batch formed.
        counters: dict[str, int] = await self._model.stats.remote()
        counters.update(self._counters)
        return gateway_pb2.GetStatsResponse(counters=counters)


def _check_port_free(port: int) -> None:
    # Fails fast with a clear message, before Ray starts, rather than somewhere inside the
    # proxy actor's start-up.
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        # As any server binds: a listener fails this, a previous run's TIME_WAIT does not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("::", port))
        except OSError as exc:
            raise RuntimeError(f"gRPC port {port} is not free: {exc}") from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _probe(port: int, deadline: float, stop: threading.Event) -> None:
    """Wait until a real Predict answers through the proxy (it may start after serve.run)."""
    target = f"127.0.0.1:{port}"
    last: Exception | None = None
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        while time.monotonic() < deadline and not stop.is_set():
            try:
                timeout = max(0.5, min(10.0, deadline - time.monotonic()))
                reply = stub.Predict(gateway_pb2.PredictRequest(text=PROBE_TEXT), timeout=timeout)
                if reply.prediction.label:
                    return
                last = RuntimeError(f"empty prediction from {target}: {reply}")
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.2)
    if not stop.is_set():
        raise RuntimeError(f"no Predict answered on {target}: {last}")


def _deploy(args: argparse.Namespace, repo: str, cfg: ModelConfig) -> None:
    # Serve's driver-side logger says INFO about every step of the deploy on stderr.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(
        # The HTTP proxy always starts; keep it off the default 8000, which may be taken.
        http_options=HTTPOptions(host="127.0.0.1", port=_free_port()),
        grpc_options=gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[SERVICER]),
        logging_config=LOGGING,
    )
    model = _deployment(Model, max(MIN_ONGOING, args.max_batch_size)).bind(
        repo, cfg.name, args.model_threads, args.max_batch_size, args.batch_wait_ms / 1e3
    )
    app = _deployment(Ingress).bind(
        repo,
        cfg.name,
        _deployment(Tokenizer).bind(repo, cfg.name),
        model,
        _deployment(Postprocess).bind(repo, cfg.name),
    )
    # Not serve.run: it waits for RUNNING without a timeout, so a replica that cannot be
    # placed would hang the start-up; the caller polls the status against its deadline.
    # The default route prefix stays: None would hide the app from the gRPC proxy too.
    serve.run_many(
        [serve.RunTarget(target=app, name=APP_NAME, logging_config=LOGGING)],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )


def _serve(
    args: argparse.Namespace, stop: threading.Event, on_signal: _Handler, out: TextIO
) -> int:
    """Start, print READY, serve until `stop`; the caller shuts Ray down whatever happens.

    The signal handlers only set `stop`, checked between steps: an exception raised from a
    handler into Ray's waits can be swallowed by Ray's own error handling.
    """
    deadline = time.monotonic() + args.startup_timeout
    repo = str(Path(args.model_repo).resolve())
    cfg = _config(repo, args.model)  # fails here, clearly, before Ray starts
    _check_port_free(args.grpc_port)
    ray.init(
        # Never join another Ray instance on this machine (RAY_ADDRESS, /tmp/ray).
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
        # Requests and results are a few KB and go inline; the store needs only its minimum.
        object_store_memory=128 * 1024 * 1024,
    )
    # ray.init put in its own SIGTERM handler (sys.exit) for the time it runs.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if not stop.is_set():
        _deploy(args, repo, cfg)
    while not stop.is_set() and time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        state = app.status if app is not None else ApplicationStatus.NOT_STARTED
        if state == ApplicationStatus.RUNNING:
            _probe(args.grpc_port, deadline, stop)
            break
        if app is not None and state in (
            ApplicationStatus.DEPLOY_FAILED,
            ApplicationStatus.UNHEALTHY,
        ):
            # The application's message only names the deployments; theirs hold the error.
            details = "; ".join(
                f"{name}: {d.message}" for name, d in app.deployments.items() if d.message
            )
            raise RuntimeError(f"application {state.value}: {app.message} {details}"[:4000])
        stop.wait(0.25)
    if stop.is_set():
        print("ray_serve peer: stopped by a signal before it was ready", file=sys.stderr)
        return 1
    if time.monotonic() >= deadline:
        print(f"ray_serve peer: not ready after {args.startup_timeout:.0f} s", file=sys.stderr)
        return 1
    print(f"READY 127.0.0.1:{args.grpc_port}", file=out, flush=True)
    while not stop.wait(1.0):
        pass
    return 0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from Linux's /proc; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The fields after the parenthesised name: state, ppid, ..., starttime (the 20th).
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process below `root` (empty where there is no /proc)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def _reaped(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return _stat(pid) is None


def _shutdown() -> None:
    # Listed before each step: once the raylet is gone, its children are re-parented and
    # can no longer be told from anyone else's.
    ours = _descendants(os.getpid())
    # Each step on its own: a failed Serve shutdown must not leave Ray's processes behind.
    try:
        if ray.is_initialized():
            serve.shutdown()  # type: ignore[no-untyped-call]
    except Exception as exc:
        print(f"ray_serve peer: serve.shutdown failed: {exc!r}", file=sys.stderr)
    finally:
        ours |= _descendants(os.getpid())
        ray.shutdown()
    # ray.shutdown() stops what it started, but an agent the raylet was still starting can
    # outlive it (seen with the dashboard and runtime-env agents after an interrupted
    # start-up): the benchmark box must be left as it was found.
    left: list[int] = []
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        # The start time tells a straggler from a new process that reused its pid.
        left = [pid for pid, start in ours.items() if (_stat(pid) or (0, -1))[1] == start]
        if not left:
            return
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    # Gone once reaped (those that are our own children, by us), so that whoever checks
    # right after this exits finds neither processes nor zombies.
    end = time.monotonic() + 2.0
    while time.monotonic() < end and not all(_reaped(pid) for pid in left):
        time.sleep(0.05)
    print(f"ray_serve peer: killed {len(left)} Ray processes left after shutdown", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--model-repo", default=os.environ.get("HOPLINE_MODEL_REPO", "models"))
    parser.add_argument("--model", default="support-intents")
    parser.add_argument(
        "--model-threads",
        type=int,
        default=0,
        help="ONNX Runtime intra-op threads of the Model deployment (0: ORT's default, all "
        "cores, as hopline's inference service)",
    )
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0)
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    if args.max_batch_size < 1 or args.batch_wait_ms < 0 or args.model_threads < 0:
        parser.error("--max-batch-size must be >= 1, --batch-wait-ms and --model-threads >= 0")

    # stdout carries the READY line and nothing else: Ray's driver prints errors pushed from
    # the cluster (a failed task at shutdown, say) to whatever sys.stdout is at the time.
    ready_out = sys.stdout
    sys.stdout = sys.stderr
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only a request: the main thread acts on it at its next check, and a second
        # signal cannot cut the shutdown short and orphan Ray's processes.
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    code = 1
    try:
        code = _serve(args, stop, on_signal, ready_out)
    except SystemExit:
        # ray.init's own SIGTERM handler, for a signal while ray.init runs.
        print("ray_serve peer: stopped by a signal before it was ready", file=sys.stderr)
    except Exception as exc:
        print(f"ray_serve peer: failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        _shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
