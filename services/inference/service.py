"""hopline.inference.v1.InferenceService on grpc.aio."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time

import grpc
import numpy as np
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument as OrtInvalidArgument
from opentelemetry import trace

from hopline.model.registry import LINGER_REFRESHES, ModelRegistry
from hopline.model.repository import (
    InvalidModelError,
    ModelConfig,
    ModelNotFoundError,
    ModelRepository,
    TensorSpec,
    version_digest,
)
from hopline.model.run_width import run_slots
from hopline.model.spin import Spin
from hopline.observability import schema
from hopline.observability.logs import Episodes
from hopline.observability.tracing import tracer
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.runtime.batching import QueueFullError
from hopline.runtime.config import (
    Range,
    ServerConfig,
    env_field,
    listen_field,
    metrics_port_field,
    model_refresh_field,
)
from hopline.runtime.errors import status_text
from hopline.runtime.memory import release_freed_memory
from hopline.runtime.priority import nicer_executor, on_nicer_thread
from hopline.runtime.tensors import (
    DTYPE_CODES,
    TensorError,
    by_name,
    dtype_name,
    from_tensor,
    to_tensor,
)
from hopline.services.inference.backend import (
    Array,
    create_backend,
    graph_problem,
    warm_up,
)
from hopline.services.inference.batched_model import (
    BatchedModel,
    EmbeddingHead,
    ModelRequest,
    NeverFitsError,
)

log = logging.getLogger("hopline.inference")


async def _close_when_idle(model: BatchedModel) -> None:
    await model.batcher.wait_idle()
    await model.close()


# A run that fails fails every request in its batch, and a model that fails once often fails
# every run: its traceback once an episode, by model version (observability/logs.py).
RUN_FAILURES = Episodes(log, "model run failed", level=logging.ERROR)
# ONNX Runtime refusing inputs that passed `_validate`: answered as the request's mistake, yet
# a graph that fails on valid ids (a bad build) is the likelier cause, and with the runtime's
# own lines silenced (model/session.py) nothing else would tell the operator.
REFUSED_RUNS = Episodes(log, "model refused a run's inputs")
# A loaded version the model list cannot carry: left out of every list, said once an episode.
UNLISTABLE = Episodes(log, "model version left out of the model list")
# Threads a run or runs at once: far past any machine's cores, below what wedged a start
# (100,000 intra-op threads: ONNX Runtime's session creation never returned, nor the drain).
THREADS = Range(high=1024)


@dataclasses.dataclass(frozen=True)
class InferenceConfig(ServerConfig):
    listen: str = listen_field("inference")
    metrics_port: int = metrics_port_field("inference")
    model_repo: str = env_field("HOPLINE_MODEL_REPO", "models", "model repository directory")
    model_refresh_s: float = model_refresh_field(
        "how often gateways re-read the model list: a removed version is still served when "
        "named for two of these"
    )
    # 0/0: a run alone gets every core, runs side by side one each, as many as cores
    # (services/inference/backend.py:SideBySideBackend has the figures).
    threads: int = env_field(
        "HOPLINE_INFERENCE_THREADS",
        0,
        "ONNX Runtime intra-op threads per run (0: every core for a run alone, one core each "
        "for runs side by side)",
        valid=THREADS,
    )
    workers: int = env_field(
        "HOPLINE_INFERENCE_WORKERS",
        0,
        "model runs in parallel (0: one per core and one more)",
        valid=THREADS,
    )
    # 'run' with threads that spin at most model/session.py:RUN_SPIN_US per wait, against
    # 'off', meshes side by side on 2 shared cores, miss, alternated rounds (stop 35):
    # five processes c=1 p50 16.80 -> 14.65 ms (unbounded spin), and bounded in three runs
    # 18.13 -> 15.25, 19.57 -> 16.53, 18.37 -> 16.93, 16.89 -> 15.05 ms with p99 32.6 -> 63.1,
    # 37.7 -> 49.1, 44.4 -> 42.9, 31.9 -> 30.0 ms (the c=1 tail moves by more than that
    # between runs here), c=32 163.6
    # vs 162.6 rps, open loop 100 rps p50 93.8 -> 83.2 ms, p99 357 -> 283; co-located c=1
    # p50 12.77 -> 11.44 ms, p99 24.9 -> 23.2, c=32 172.2 -> 182.6 rps, open loop 120 rps p99
    # 189 -> 185.
    # (An unbounded spin had cost the co-located mesh c=1 p99 and c=32 rps in earlier stops.)
    spin: Spin = env_field(
        "HOPLINE_INFERENCE_SPIN",
        Spin.RUN,
        "what ONNX Runtime's threads do between operators: 'off' (sleep), 'run' (spin a "
        "little while a run is in progress) or 'always' (spin between runs too: only on "
        "cores nothing else needs)",
    )
    # 5 against 0 (runtime/priority.py), meshes side by side on 2 shared cores, miss,
    # alternated rounds (stop 43): co-located, open loop at 101 rps, p50 in 9 of 10 rounds
    # lower (medians 78.5 -> 60.7 ms over 4 rounds, 80.8 -> 67.0 over 6), p99 no better
    # (217.7 vs 215.4), c=32 151.4 -> 153.1 and 143.6 -> 148.4 rps, c=1 p50 15.96 -> 14.87
    # and 15.21 -> 14.63 ms; five processes (4 rounds), open loop at 75 rps p50 73.9 -> 68.1
    # ms in every round (p99 185.5 vs 192.0), c=1 p50 20.71 -> 19.43 in every round, c=32
    # 135.1 -> 149.5 rps (3 of 4). Nice 15 against 5 (4 rounds): no lower p50, p99 worse.
    nice: int = env_field(
        "HOPLINE_INFERENCE_NICE",
        5,
        "how many steps nicer than the event loop the threads that run models are (Linux; "
        "0: the same): the loop preempts a run when a request needs it",
        valid=Range(high=19),
    )
    # 100 against the kernel's default (1.4 ms on 2 cores: runtime/priority.py), the
    # co-located mesh's model threads switched on a running `make run` (Linux 6.18, AMD EPYC
    # VM, 2 cores), alternated rounds (2026-12-03): c=1 misses p50 lower in 5 of 6 (medians 4.39
    # against 4.88 ms), c=32 336, 332, 358 and 310 rps against 328, 329, 334 and 242, open
    # loop at 240 rps p50 median 16.1 against 15.9 ms (6 rounds, the hour's spread 13.9-17.5).
    slice_us: int = env_field(
        "HOPLINE_INFERENCE_SLICE_US",
        100,
        "the scheduler slice the threads that run models ask for, in microseconds (Linux "
        "6.12 and later; 0: the kernel's default, about 1.4 ms on 2 cores; the kernel grants "
        "0.1 ms at least): a request's step on the event loop preempts a run within it",
        valid=Range(high=100_000),
    )


TOKEN_IDS, ATTENTION_MASK = "input_ids", "attention_mask"


def _validate(
    cfg: ModelConfig, request: inference_pb2.InferRequest, vocab: int | None
) -> dict[str, Array]:
    """The request's tensors, checked against the model's declared inputs, and token ids
    against its vocabulary: an id outside it fails the run (a negative one wraps round to
    another token), and with it every request sharing the run."""
    given = by_name(request.inputs, "input")
    unknown = set(given) - {s.name for s in cfg.inputs}
    if unknown:
        raise TensorError(f"{cfg.key} has no input(s) {sorted(unknown)}")
    arrays: dict[str, Array] = {}
    for spec in cfg.inputs:
        if spec.name not in given:
            raise TensorError(f"{cfg.key} needs input {spec.name!r}")
        tensor = given[spec.name]
        if tensor.dtype != DTYPE_CODES[spec.dtype]:
            raise TensorError(
                f"input {spec.name!r} must be {spec.dtype}, got {dtype_name(tensor.dtype)}"
            )
        array = from_tensor(tensor)
        if array.ndim != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)
        ):
            raise TensorError(
                f"input {spec.name!r} must have shape {list(spec.shape)}, got {list(array.shape)}"
            )
        arrays[spec.name] = array
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1:
        raise TensorError(f"inputs must share one shape, got {sorted(shapes)}")
    batch, seq = next(iter(shapes))[:2]
    if not 1 <= batch <= cfg.max_batch_size:
        raise TensorError(f"batch of {batch}; {cfg.key} takes 1 to {cfg.max_batch_size}")
    if not 1 <= seq <= cfg.max_sequence_length:
        raise TensorError(f"sequence of {seq}; {cfg.key} takes 1 to {cfg.max_sequence_length}")
    _check_tokens(cfg, arrays, vocab)
    return arrays


def _check_tokens(cfg: ModelConfig, arrays: dict[str, Array], vocab: int | None) -> None:
    ids, mask = arrays.get(TOKEN_IDS), arrays.get(ATTENTION_MASK)
    if ids is not None and vocab is not None and _largest(ids) >= vocab:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise TensorError(
                f"input {TOKEN_IDS!r} holds token id {low if low < 0 else high}; "
                f"{cfg.key} takes ids 0 to {vocab - 1}"
            )
    if mask is not None and (
        _largest(mask) > 1 if _integral(mask) else ((mask != 0) & (mask != 1)).any()
    ):
        raise TensorError(f"input {ATTENTION_MASK!r} must hold only 0 and 1")


_UNSIGNED = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}  # by item size


def _integral(array: Array) -> bool:
    return array.dtype.kind in "iub"


def _largest(array: Array) -> float:
    """The largest element, an integer array's read as unsigned (a negative one is then
    larger than any vocabulary): one reduction where min, max and four comparisons were
    half of _validate's time at 32 callers (py-spy; 4.6 -> 2.8 us a row hot)."""
    if _integral(array):
        return int(array.view(_UNSIGNED[array.itemsize]).max())
    return math.inf if array.min() < 0 else float(array.max())


def _run_failure(cfg: ModelConfig, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """A failed model run as a status: ONNX Runtime's INVALID_ARGUMENT is about the inputs it
    was given (something `_validate` does not check), anything else is this service's."""
    if isinstance(exc, OrtInvalidArgument):
        details = status_text(f"{cfg.key} cannot run these inputs: {exc}")
        REFUSED_RUNS.failed(cfg.key, type(exc).__name__, model=cfg.key, error=details)
        return grpc.StatusCode.INVALID_ARGUMENT, details
    RUN_FAILURES.failed(cfg.key, type(exc).__name__, exc, model=cfg.key)
    return grpc.StatusCode.INTERNAL, status_text(
        f"{cfg.key}'s run failed: {type(exc).__name__}: {exc}"
    )


def _model_info(cfg: ModelConfig, model: BatchedModel) -> inference_pb2.ModelInfo:
    def specs(items: tuple[TensorSpec, ...]) -> list[inference_pb2.TensorSpec]:
        return [
            inference_pb2.TensorSpec(
                name=s.name,
                dtype=common_pb2.DataType.Value("DATA_TYPE_" + s.dtype),
                shape=list(s.shape),
            )
            for s in items
        ]

    return inference_pb2.ModelInfo(
        name=cfg.name,
        version=cfg.version,
        task=cfg.task,
        backend=cfg.backend,
        inputs=specs(cfg.inputs),
        outputs=specs(cfg.outputs),
        max_batch_size=cfg.max_batch_size,
        labels=list(cfg.labels),
        cache=inference_pb2.CachePolicy(
            mode=cfg.cache.mode,
            threshold=cfg.cache.threshold,
            ttl_s=cfg.cache.ttl_s,
            max_entries=cfg.cache.max_entries,
            store_out_of_scope=cfg.cache.store_out_of_scope,
            min_score=cfg.cache.min_score,
            verify_target=cfg.cache.verify_target,
            verify_confidence=cfg.cache.verify_confidence,
        ),
        ready=True,
        precision=cfg.precision.value,
        providers=list(model.backend.providers),
        head_embedder=cfg.head_embedder,
        digest=model.digest,
    )


def _listed(cfg: ModelConfig, model: BatchedModel) -> inference_pb2.ModelInfo | None:
    """A loaded version's entry in the model list; None, said once a version, when its config
    does not fit the message: one such version failed every list read, and with it every
    gateway's view of every model (a helper's probe; load_config now bounds what it knew of)."""
    try:
        return _model_info(cfg, model)
    except (ValueError, TypeError) as exc:
        UNLISTABLE.failed(cfg.key, type(exc).__name__, model=cfg.key, error=str(exc))
        return None


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):
    service_names = (inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,)

    def __init__(self, config: InferenceConfig) -> None:
        self.config = config
        self.models: ModelRegistry[BatchedModel] = ModelRegistry(
            ModelRepository.setting(config.model_repo),
            self._load,
            on_retire=self._retired,
            linger_s=LINGER_REFRESHES * config.model_refresh_s,
            digest_of=lambda model: model.digest,
        )
        self.executor = nicer_executor(self.concurrency, "model", config.nice, config.slice_us)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def _load(self, cfg: ModelConfig) -> BatchedModel:
        # Built on a nicer thread, so ONNX Runtime's pool threads are as nice as the runs'.
        backend = on_nicer_thread(
            self.config.nice,
            lambda: create_backend(cfg, self.config.threads, spin=self.config.spin),
            self.config.slice_us,
        )
        if problem := graph_problem(backend):
            raise InvalidModelError(f"{cfg.key}: {problem}")
        warm_up(backend)
        return BatchedModel(backend, self.executor, self.concurrency, version_digest(cfg.path))

    def _retired(self, model: BatchedModel) -> None:
        """A version removed or changed in the repository (the registry calls this from the
        thread that rescanned): its batcher is closed once the requests on it are done."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._close_when_idle, model)

    def _close_when_idle(self, model: BatchedModel) -> None:
        task = asyncio.ensure_future(_close_when_idle(model))
        self._closing.add(task)
        task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task[None]) -> None:
        """A retired version is closed, and with its last reference its sessions are freed;
        their memory goes back to the system from the allocator's arenas
        (runtime/memory.py), off the loop."""
        self._closing.discard(task)
        if not task.cancelled() and self._loop is not None and not self._loop.is_closed():
            self._loop.run_in_executor(None, release_freed_memory)

    @property
    def concurrency(self) -> int:
        """Runs this service makes at once: how many calls a co-located caller keeps on their
        way so that a freed run slot never waits for the caller's next batch."""
        return run_slots(self.config.workers)

    def register(self, server: grpc.aio.Server) -> None:
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self, server)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        loaded = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.models.load_all
        )
        if not loaded:
            self.models.check_start()

    async def stop(self) -> None:
        for task in self._closing:
            task.cancel()
        for _, model in self.models.loaded():
            await model.close()
        self.executor.shutdown(wait=True)

    async def Infer(
        self,
        request: inference_pb2.InferRequest,
        context: grpc.aio.ServicerContext[inference_pb2.InferRequest, inference_pb2.InferResponse],
    ) -> inference_pb2.InferResponse:
        try:
            cfg, model = await self.models.find(
                request.model, request.model_version, request.model_digest
            )
        except ModelNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, status_text(str(exc)))
        known = [o.name for o in cfg.outputs]
        missing = [name for name in request.outputs if name not in known]
        if missing:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                status_text(f"{cfg.key} has no output(s) {missing}; has {known}"),
            )
        if [t.name for t in request.inputs] == [EmbeddingHead.INPUT]:
            try:
                return self._infer_from_embedding(cfg, model, request)
            except TensorError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_text(str(exc)))
        try:
            inputs = _validate(cfg, request, model.vocab)
        except TensorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_text(str(exc)))
        batch, seq = next(iter(inputs.values())).shape[:2]
        try:
            outputs, run = await model.infer(
                ModelRequest(inputs, tuple(request.outputs), int(batch), int(seq))
            )
        except NeverFitsError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_text(str(exc)))
        except QueueFullError as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"inference queue for {cfg.key} is full: {exc}; retry with backoff, or add "
                "inference replicas",
            )
        except Exception as exc:  # the run failed: the status says whose fault it was
            await context.abort(*_run_failure(cfg, exc))
        RUN_FAILURES.ended(cfg.key)
        REFUSED_RUNS.ended(cfg.key)
        # The run happened on a worker thread, possibly for several requests at once: each
        # request's spans are written from the batch's timestamps, under its own server span.
        if trace.get_current_span().is_recording():
            attrs = {schema.MODEL: cfg.name, schema.MODEL_VERSION: cfg.version}
            # A request that ran at once waited for nothing: no queue span (a zero-length one
            # was flagged by Jaeger in every trace, "Negative duration detected").
            if run.started_ns > run.enqueued_ns:
                tracer().start_span(
                    schema.SPAN_INFERENCE_QUEUE, start_time=run.enqueued_ns, attributes=attrs
                ).end(end_time=run.started_ns)
            tracer().start_span(
                schema.SPAN_INFERENCE_RUN,
                start_time=run.started_ns,
                attributes={**attrs, schema.BATCH_SIZE: run.rows},
            ).end(end_time=run.finished_ns)
        return inference_pb2.InferResponse(
            model=cfg.name,
            model_version=cfg.version,
            outputs=[to_tensor(name, np.asarray(value)) for name, value in outputs.items()],
            queue_ms=(run.started_ns - run.enqueued_ns) / 1e6,
            compute_ms=(run.finished_ns - run.started_ns) / 1e6,
            model_digest=model.digest,
        )

    def _infer_from_embedding(
        self, cfg: ModelConfig, model: BatchedModel, request: inference_pb2.InferRequest
    ) -> inference_pb2.InferResponse:
        """The head alone on embeddings the caller holds (gateway: the cache lookup's)."""
        if model.head is None:
            raise TensorError(
                f"{cfg.key} takes token ids ({', '.join(s.name for s in cfg.inputs)}), not "
                f"{EmbeddingHead.INPUT}: it names no head_embedder (an FP32 build has one; a "
                "converted encoder's embeddings are not the cache's)"
            )
        embeddings = from_tensor(request.inputs[0])
        if embeddings.dtype != np.float32 or embeddings.ndim != 2:
            raise TensorError(
                f"{EmbeddingHead.INPUT} must be FP32 [rows, {model.head.dim}], got "
                f"{dtype_name(request.inputs[0].dtype)} {list(embeddings.shape)}"
            )
        rows, dim = embeddings.shape
        if dim != model.head.dim or not 1 <= rows <= cfg.max_batch_size:
            raise TensorError(
                f"{EmbeddingHead.INPUT} must be [1..{cfg.max_batch_size}, {model.head.dim}], "
                f"got {list(embeddings.shape)}"
            )
        started = time.time_ns()
        logits = model.head.run(embeddings)
        finished = time.time_ns()
        if trace.get_current_span().is_recording():
            tracer().start_span(
                schema.SPAN_INFERENCE_RUN,
                start_time=started,
                attributes={
                    schema.MODEL: cfg.name,
                    schema.MODEL_VERSION: cfg.version,
                    schema.BATCH_SIZE: rows,
                    schema.HEAD_ONLY: True,
                },
            ).end(end_time=finished)
        produced = {"logits": logits, EmbeddingHead.INPUT: embeddings}
        names = list(request.outputs) or [o.name for o in cfg.outputs]
        return inference_pb2.InferResponse(
            model=cfg.name,
            model_version=cfg.version,
            outputs=[to_tensor(name, produced[name]) for name in names],
            compute_ms=(finished - started) / 1e6,
            model_digest=model.digest,
        )

    async def ListModels(
        self,
        request: inference_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext[
            inference_pb2.ListModelsRequest, inference_pb2.ListModelsResponse
        ],
    ) -> inference_pb2.ListModelsResponse:
        # New versions load first, off the event loop, so a caller (the gateway's catalogue)
        # only ever routes to a version that loaded; one that fails is left out.
        await asyncio.get_running_loop().run_in_executor(None, self.models.load_new)
        return inference_pb2.ListModelsResponse(
            models=[i for cfg, model in self.models.loaded() if (i := _listed(cfg, model))],
            left_out=[
                inference_pb2.LeftOutVersion(name=name, version=version, reason=reason)
                for (name, version), reason in sorted(self.models.left_out().items())
            ],
        )
