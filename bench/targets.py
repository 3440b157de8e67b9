"""What `hopline bench` can measure: the mesh (or a peer) over gRPC, a bare echo server,
and the same pipeline in one process, with and without the inference service's batcher.

A target turns a text into a payload before the window (`payload`), sends it (`call`, or for
one caller of a gRPC target `blocking()`'s call: bench/load.py says why), and after the window
says what a response was (`describe`: cache outcome and per-hop timings).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import grpc
import numpy as np

from hopline.model.repository import ModelConfig
from hopline.model.spin import Spin
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime.cpu_quota import usable_cpus
from hopline.runtime.priority import nicer_executor, on_nicer_thread
from hopline.runtime.tls import ClientTls, aio_channel, channel
from hopline.services.inference.backend import create_backend
from hopline.services.inference.batched_model import BatchedModel, ModelRequest
from hopline.services.postprocess.logic import predictions

PREDICT = "/hopline.gateway.v1.GatewayService/Predict"
ECHO = "/hopline.bench.Echo/Echo"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


class Target(Protocol):
    name: str

    def payload(self, text: str) -> Any: ...

    async def call(self, payload: Any) -> Any: ...

    def blocking(self) -> Callable[[Any], Any] | None:
        """The same call on the calling thread, for a lone caller; None: `call` only."""
        ...

    def describe(self, response: Any) -> tuple[str | None, dict[str, float]]: ...

    async def close(self) -> None: ...


class PredictTarget:
    """hopline's gateway, or a peer that speaks its Predict, over `connections` gRPC
    connections, calls spread over them in turn (a server's SO_REUSEPORT workers share out
    connections, not calls, so one connection reaches one worker).

    The method is called with raw bytes (no serialiser): requests are serialised before the
    window and responses decoded after it, so the load generator does no protobuf work while
    it measures.
    """

    def __init__(
        self,
        name: str,
        address: str,
        *,
        model: str = "",
        model_version: str = "",
        tenant: str = "",
        cache_mode: common_pb2.CacheMode.ValueType = common_pb2.CACHE_MODE_USE,
        metadata: Sequence[tuple[str, str]] = (),
        timeout_s: float = 30.0,
        method: str = PREDICT,
        tls: ClientTls | None = None,
        connections: int = 1,
    ) -> None:
        self.name = name
        self.address = address
        self.model = model
        self.model_version = model_version
        self.tenant = tenant
        self.cache_mode = cache_mode
        self.metadata = tuple(metadata)
        self.timeout_s = timeout_s
        # A subchannel pool per channel: by default gRPC shares one connection between
        # channels to the same address with the same arguments.
        self.connections = max(1, connections)
        self._options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self._tls, self._method = tls, method
        # Each kind opened by its first use: while any grpc.aio channel lives, gRPC's aio
        # poller thread takes part in polling every socket of the process, the blocking
        # stub's too, and hands their replies over (bench/load.py).
        self._aio: list[grpc.aio.Channel] = []
        self._aio_calls: Iterator[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] | None = None
        self._blocking_channels: list[grpc.Channel] = []

    def payload(self, text: str) -> bytes:
        return gateway_pb2.PredictRequest(
            text=text,
            model=self.model,
            model_version=self.model_version,
            tenant=self.tenant,
            cache_mode=self.cache_mode,
        ).SerializeToString()

    async def call(self, payload: bytes) -> bytes:
        if self._aio_calls is None:
            self._aio = [
                aio_channel(self.address, self._tls, self._options) for _ in range(self.connections)
            ]
            self._aio_calls = itertools.cycle(
                [c.unary_unary(self._method, None, None) for c in self._aio]
            )
        call = next(self._aio_calls)
        reply: bytes = await call(payload, timeout=self.timeout_s, metadata=self.metadata)
        return reply

    def blocking(self) -> Callable[[bytes], bytes]:
        """`call` on gRPC's synchronous stub, over as many connections of its own."""
        if not self._blocking_channels:
            self._blocking_channels = [
                channel(self.address, self._tls, self._options) for _ in range(self.connections)
            ]
        calls = itertools.cycle(
            [c.unary_unary(self._method, None, None) for c in self._blocking_channels]
        )
        timeout_s, metadata = self.timeout_s, self.metadata

        def call(payload: bytes) -> bytes:
            reply: bytes = next(calls)(payload, timeout=timeout_s, metadata=metadata)
            return reply

        return call

    def describe(self, response: bytes) -> tuple[str | None, dict[str, float]]:
        reply = gateway_pb2.PredictResponse.FromString(response)
        outcome = common_pb2.CacheOutcome.Name(reply.cache.outcome).removeprefix("CACHE_OUTCOME_")
        return outcome.lower(), {t.hop: t.ms for t in reply.timings}

    async def close(self) -> None:
        for aio in self._aio:
            await aio.close(None)
        for blocking in self._blocking_channels:
            blocking.close()
        self._aio, self._aio_calls, self._blocking_channels = [], None, []


class EchoTarget(PredictTarget):
    """The transport's floor: the same request bytes to a server that only sends them back."""

    def __init__(self, address: str, name: str = "echo") -> None:
        super().__init__(name, address, method=ECHO)

    def describe(self, response: bytes) -> tuple[str | None, dict[str, float]]:
        return None, {}


def inprocess_threads(concurrency: int) -> tuple[int, int]:
    """(parallel runs, ONNX Runtime threads per run) for the plain in-process baseline.

    The strongest plain setting, so the mesh is compared with the best a single process can
    do without batching: one run over all cores for a lone caller (lowest latency), one
    single-threaded run per core under concurrent callers (highest throughput: 400 vs 267
    rows/s for one 2-thread run on 2 cores, measured).
    """
    cores = usable_cpus()
    workers = max(1, min(concurrency, cores))
    return workers, max(1, cores // workers)


@dataclasses.dataclass(frozen=True)
class InProcessReply:
    """An in-process request's answer, and its model run timed as the inference service's
    batcher times a mesh's (`inference.queue`: waiting for a free run slot;
    `inference.compute`: from the run's hand-over to a model thread until the event loop has
    its result, thread wake-ups included), so the model's own run reads alike in process and
    in a mesh (bench/suite_report.py:model_run_share)."""

    prediction: common_pb2.Prediction
    timings: dict[str, float]


def _run_timings(enqueued_ns: int, started_ns: int, finished_ns: int) -> dict[str, float]:
    return {
        "inference.queue": (started_ns - enqueued_ns) / 1e6,
        "inference.compute": (finished_ns - started_ns) / 1e6,
    }


class InProcessTarget:
    """Tokenizer, model and postprocessing called in this process: no hops, no cache.

    With `batched`, requests go through the inference service's own BatchedModel (the same
    dynamic batcher, policy and thread settings); without, each request runs alone.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        batched: bool,
        workers: int,
        threads: int,
        spin: Spin,
        nice: int = 0,
        slice_us: int = 0,
        top_k: int = 1,
        suffix: str = "",
    ) -> None:
        self.name = ("inprocess_batched" if batched else "inprocess") + suffix
        self.config = config
        self.top_k = top_k
        self.tokenizer = load_tokenizer(config.file("tokenizer"), config.max_sequence_length)
        # The model's threads as nice as the inference service's (runtime/priority.py).
        self.backend = on_nicer_thread(
            nice, lambda: create_backend(config, threads, spin=spin), slice_us
        )
        self.executor = nicer_executor(workers, "inprocess", nice, slice_us)
        self.workers = workers
        self._running = 0  # runs handed to the executor and not yet back
        self.model = BatchedModel(self.backend, self.executor, workers) if batched else None
        self.settings = {
            "workers": workers,
            "threads": threads,
            "spin": spin.value,
            "nice": nice,
            "slice_us": slice_us,
            "batched": batched,
        }

    def payload(self, text: str) -> str:
        return text

    def _tensors(self, text: str) -> dict[str, Any]:
        batch = encode(self.tokenizer, [text])
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}

    def _alone(self, text: str) -> tuple[np.ndarray[Any, Any], int]:
        started = time.time_ns()
        logits: np.ndarray[Any, Any] = self.backend.run(self._tensors(text), ["logits"])["logits"]
        return logits, started

    async def _run_alone(self, text: str) -> tuple[np.ndarray[Any, Any], dict[str, float]]:
        """One run on the executor. A run handed over while a thread is free starts at once,
        as the batcher hands runs only to a free slot: all of it is compute. One that waits in
        the executor's queue waited from hand-over to its thread's start (time.time_ns, as
        the batcher's clock). This pipeline tokenizes on the model's thread (about 30 us),
        inside its compute."""
        free = self._running < self.workers
        self._running += 1
        handed = time.time_ns()
        try:
            logits, started = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._alone, text
            )
        finally:
            self._running -= 1
        return logits, _run_timings(handed, handed if free else started, time.time_ns())

    async def call(self, text: str) -> InProcessReply:
        if self.model is None:
            logits, timings = await self._run_alone(text)
        else:
            # Tokenized on the event loop, as the tokenizer service does (about 30 us).
            inputs = self._tensors(text)
            rows, length = inputs["input_ids"].shape
            outputs, run = await self.model.infer(ModelRequest(inputs, ("logits",), rows, length))
            logits = outputs["logits"]
            timings = _run_timings(run.enqueued_ns, run.started_ns, run.finished_ns)
        cfg = self.config
        prediction = predictions(logits, None, cfg.labels, cfg.oos_threshold, self.top_k)[0]
        return InProcessReply(prediction, timings)

    def blocking(self) -> None:
        """None: measured on the event loop, as a service would call its own pipeline."""
        return None

    def describe(self, response: InProcessReply) -> tuple[str | None, dict[str, float]]:
        return None, response.timings

    async def close(self) -> None:
        if self.model is not None:
            await self.model.close()
        self.executor.shutdown(wait=True)
