"""A loaded model behind the dynamic batcher: requests merged into one padded run, split back.

Each Infer request carries [rows, length] token tensors. Requests that run together are
stacked row-wise and right-padded with zeros to the longest (a zero attention mask makes a
padded position invisible to the encoder, and right padding leaves position ids alone), and
every output is cut back to the request's own rows and, for per-token outputs, its own
length. Labels are identical to a run alone; scores differ only by float rounding (padding
changes the GEMM shapes: at most 5e-7 in the logits, measured on the default model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from hopline.model.repository import (
    LABELS_OUTPUT,
    SENTENCE_EMBEDDING,
    InvalidModelError,
    ModelConfig,
)
from hopline.model.session import make_session
from hopline.model.tokenizer import vocab_size
from hopline.observability import metrics
from hopline.runtime.batching import BatchInfo, DynamicBatcher
from hopline.services.inference.backend import Array, Backend


@dataclasses.dataclass(frozen=True)
class ModelRequest:
    inputs: dict[str, Array]  # each [rows, length, ...]
    outputs: tuple[str, ...]  # empty: every output
    rows: int
    length: int


def _stack(arrays: Sequence[Array], length: int) -> Array:
    """Row-wise concatenation, right-padding axis 1 with zeros to `length`."""
    if all(a.ndim < 2 or a.shape[1] == length for a in arrays):
        return np.concatenate(arrays, axis=0)
    first = arrays[0]
    out = np.zeros((sum(a.shape[0] for a in arrays), length, *first.shape[2:]), first.dtype)
    row = 0
    for a in arrays:
        out[row : row + a.shape[0], : a.shape[1]] = a
        row += a.shape[0]
    return out


class EmbeddingHead:
    """The version's classifier head alone, for callers that hold a text's embedding from
    the encoder the version names (`head_embedder`: the cache computed it for its lookup).

    A [rows, 384] x [384, classes] product takes microseconds, so it runs on the calling
    thread: an executor hand-off would cost more than the run, and it never waits behind
    the encoder runs in the batcher."""

    INPUT = SENTENCE_EMBEDDING

    def __init__(self, config: ModelConfig) -> None:
        self.session = make_session(config.file("head"), threads=1)
        self.dim = int(self.session.get_inputs()[0].shape[1])
        if problem := head_problem(self.session, config):
            raise InvalidModelError(f"{config.file('head')}: {problem}")

    def run(self, embeddings: Array) -> Array:
        logits: Array = self.session.run([LABELS_OUTPUT], {self.INPUT: embeddings})[0]
        return logits


def head_problem(session: Any, config: ModelConfig) -> str | None:
    """How a head graph disagrees with its version's labels, or None. A head of another
    build (23 classes beside 26 labels) loaded, became the latest, and failed every cached
    request naming no version with INVALID_ARGUMENT "logits have 23 classes", blaming the
    caller, while ModelReady said true (a model author's probe); refused at load, the version
    before keeps answering."""
    outputs = {o.name: o for o in session.get_outputs()}
    if LABELS_OUTPUT not in outputs:
        return f"the head graph has no {LABELS_OUTPUT!r} output; its outputs are {sorted(outputs)}"
    width = outputs[LABELS_OUTPUT].shape[-1]
    if isinstance(width, int) and width != len(config.labels):
        return (
            f"the head's {LABELS_OUTPUT} have {width} columns and the version has "
            f"{len(config.labels)} labels: a head of another build?"
        )
    return None


class _QueueDepth:
    """One version's batcher's part of its model's `hopline_queue_depth` series.

    Every version has a batcher of its own, and each used to set the model's one series to
    its own depth: the series read whichever version's batcher had moved last, so an idle
    version's 0 hid another's backlog. Each adds its change instead, so the series is the
    model's requests waiting over all its versions, and a version closed gives its part back.
    Its own object, not a method of the model: the batcher holds it, and a bound method
    would make the model -> batcher -> model cycle that `BatchedModel.__init__` avoids."""

    def __init__(self, model: str) -> None:
        self._series = metrics.QUEUE_DEPTH.labels("inference", model)
        self._depth = 0

    def set(self, depth: int) -> None:
        self._series.inc(depth - self._depth)
        self._depth = depth


class NeverFitsError(ValueError):
    """A request with more rows than the model's runs and queue ever hold at once: refused
    on any load, so the client's to split (INVALID_ARGUMENT), not to retry."""


class BatchedModel:
    """One model version: its backend, the batcher that feeds it, and its head if it has one."""

    def __init__(
        self, backend: Backend, executor: Executor, max_in_flight: int, digest: str = ""
    ) -> None:
        self.backend = backend
        self.digest = digest  # model/repository.py:version_digest of the files it was built from
        self.config: ModelConfig = backend.config
        self.head = EmbeddingHead(self.config) if self.config.head_embedder else None
        # Token ids this version takes (0 to vocab - 1; None: not known, nothing checked).
        self.vocab = (
            vocab_size(self.config.file("tokenizer")) if "tokenizer" in self.config.files else None
        )
        # Outputs with a dynamic second axis are per token: cut back to each request's length.
        per_token = frozenset(
            o.name for o in self.config.outputs if len(o.shape) >= 2 and o.shape[1] == -1
        )
        name = self.config.name
        self._queue_depth = _QueueDepth(name)
        # The run holds the backend, not this model: a bound method made model -> batcher ->
        # run -> model, a cycle only the collector frees, and a version loaded at start-up is
        # frozen out of its reach (runtime/collector.py), so once removed it kept its sessions
        # for the process's life.
        self.batcher: DynamicBatcher[ModelRequest, dict[str, Array]] = DynamicBatcher(
            functools.partial(_run, backend, per_token),
            dataclasses.replace(self.config.batching, max_in_flight=max_in_flight),
            executor,
            on_queue_depth=self._queue_depth.set,
            on_batch=metrics.BATCH_SIZE.labels("inference", name).observe,
        )

    async def infer(self, request: ModelRequest) -> tuple[dict[str, Array], BatchInfo]:
        """The request's outputs and how it ran. One with more rows than a run takes
        (`dynamic_batching.max_batch_size`) goes in parts of at most that many, side by side
        in the run slots, and is answered when the last part is (`_in_parts`)."""
        policy = self.batcher.policy
        most = policy.max_batch_size
        if request.rows <= most:
            return await self.batcher.submit(request, request.rows, request.length)
        # Parts beyond the free run slots wait; past the queue bound one is refused even on
        # an idle model.
        held = most * policy.max_in_flight + policy.max_queue_size
        if request.rows > held:
            raise NeverFitsError(
                f"{request.rows} rows in one request; {self.config.key} takes at most {held} "
                f"at once (max_batch_size {most} in each of {policy.max_in_flight} run slots, "
                f"max_queue_size {policy.max_queue_size} waiting): send at most {held} rows a "
                "request"
            )
        return await self._in_parts(request, most)

    async def _in_parts(
        self, request: ModelRequest, most: int
    ) -> tuple[dict[str, Array], BatchInfo]:
        parts = [
            dataclasses.replace(
                request,
                inputs={name: a[start : start + most] for name, a in request.inputs.items()},
                rows=min(most, request.rows - start),
            )
            for start in range(0, request.rows, most)
        ]
        runs = [asyncio.ensure_future(self.batcher.submit(p, p.rows, p.length)) for p in parts]
        try:
            done = await asyncio.gather(*runs)
        except BaseException:  # a part refused (a full queue) or the caller gone: none runs on
            for run in runs:
                run.cancel()
            raise
        outputs = {
            name: np.concatenate([out[name] for out, _ in done], axis=0) for name in done[0][0]
        }
        infos = [info for _, info in done]
        info = BatchInfo(
            min(i.enqueued_ns for i in infos),
            min(i.started_ns for i in infos),
            max(i.finished_ns for i in infos),
            max(i.rows for i in infos),
        )
        return outputs, info

    async def close(self) -> None:
        await self.batcher.close()
        self._queue_depth.set(0)  # the batcher dropped what waited without saying so


def _run(
    backend: Backend, per_token: frozenset[str], requests: list[ModelRequest]
) -> list[dict[str, Array]]:
    """One run of `requests`' rows, stacked and padded; each gets its own rows back (its
    length of a per-token output)."""
    wanted: list[str] = []
    if all(r.outputs for r in requests):
        wanted = sorted({name for r in requests for name in r.outputs})
    if len(requests) == 1:
        return [backend.run(requests[0].inputs, wanted or list(requests[0].outputs))]
    length = max(r.length for r in requests)
    merged = {
        name: _stack([r.inputs[name] for r in requests], length) for name in requests[0].inputs
    }
    results = backend.run(merged, wanted)
    split: list[dict[str, Array]] = []
    row = 0
    for r in requests:
        own: dict[str, Array] = {}
        for name in r.outputs or results:
            part = results[name][row : row + r.rows]
            own[name] = part[:, : r.length] if name in per_token else part
        split.append(own)
        row += r.rows
    return split
