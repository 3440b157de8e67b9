"""The cache's embedder: the same torch-free MiniLM ONNX encoder the model build uses.

The encoder file is built once from the bundled safetensors (hopline.model.encoder) and kept
under the cache's work directory, keyed by the weights' digest, so a restart loads it in well
under a second. Lookups that arrive together are embedded in one session run: while a batch
runs, the next requests queue, and the next run takes all of them (no added delay for a lone
request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from hopline.model.encoder import build_encoder
from hopline.model.session import embed_texts, make_session
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer
from hopline.observability import metrics

log = logging.getLogger("hopline.cache.embedder")

# Bump when the graph the builder writes changes, so stale cached files are rebuilt.
ENCODER_FORMAT = "1"

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EmbeddingModel:
    """Identifies a vector space: entries from different models are never compared."""

    name: str
    digest: str  # sha256 of model.safetensors
    dim: int

    @property
    def collection(self) -> str:
        # Milvus names: letters, digits and underscores.
        return f"hopline_cache_{self.name.replace('-', '_').lower()}_{self.digest[:12]}"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def embedding_model(weights_dir: Path) -> EmbeddingModel:
    return EmbeddingModel("all-MiniLM-L6-v2", _digest(weights_dir / "model.safetensors"), 384)


def encoder_file(weights_dir: Path, work_dir: Path) -> tuple[Path, EmbeddingModel]:
    """The optimised embedding-only encoder for `weights_dir`, building it if missing."""
    model = embedding_model(weights_dir)
    path = work_dir / "embedders" / f"minilm-{model.digest[:16]}-f{ENCODER_FORMAT}.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".tmp{os.getpid()}")
        log.info("building the embedding encoder", extra={"path": str(path)})
        build_encoder(weights_dir, staging)
        staging.replace(path)  # atomic: a concurrent reader sees a whole file or none
    return path, model


class Embedder:
    """Unit-length sentence embeddings, batched across concurrent callers."""

    def __init__(
        self,
        session: ort.InferenceSession,
        tokenizer: Tokenizer,
        model: EmbeddingModel,
        *,
        max_batch: int = 32,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.model = model
        self.max_batch = max_batch
        self._queue: list[tuple[str, asyncio.Future[Vector]]] = []
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        # One thread: ONNX Runtime parallelises inside a run, and runs must not overlap.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embed")
        self.batches = 0
        self.embedded = 0
        self._depth = metrics.QUEUE_DEPTH.labels("embedder", model.name)
        self._batch_size = metrics.BATCH_SIZE.labels("embedder", model.name)

    @classmethod
    def load(cls, weights_dir: Path, work_dir: Path, *, threads: int = 0) -> Embedder:
        path, model = encoder_file(weights_dir, work_dir)
        tokenizer = load_tokenizer(weights_dir / "tokenizer.json", DEFAULT_MAX_LENGTH)
        return cls(make_session(path, threads=threads), tokenizer, model)

    def embed_many(self, texts: Sequence[str], batch_size: int = 64) -> Vector:
        """Blocking bulk embedding (calibration, evaluation); shares the batching code."""
        return embed_texts(self.session, self.tokenizer, texts, batch_size=batch_size)

    async def embed(self, text: str) -> Vector:
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="loop-embedder")
        future: asyncio.Future[Vector] = asyncio.get_running_loop().create_future()
        self._queue.append((text, future))
        self._depth.set(len(self._queue))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                self._depth.set(len(self._queue))
                live = [(t, f) for t, f in batch if not f.done()]
                if not live:
                    continue
                self._batch_size.observe(len(live))
                try:
                    vectors = await loop.run_in_executor(
                        self._executor, self.embed_many, [t for t, _ in live]
                    )
                except Exception as exc:  # a failed run fails only its batch
                    for _, f in live:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                self.batches += 1
                self.embedded += len(live)
                for (_, f), v in zip(live, vectors, strict=True):
                    if not f.done():
                        f.set_result(v)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for _, f in self._queue:
            f.cancel()
        self._executor.shutdown(wait=True)
