"""The cache's embedder: the same torch-free MiniLM ONNX encoder the model build uses.

The encoder file is built once from the bundled safetensors (hopline.model.encoder) and kept
under the cache's work directory, keyed by the weights' digest, so a restart loads it in well
under a second. Texts that arrive together are embedded in one session run by the same
dynamic batcher the inference service uses (hopline.runtime.batching): a lone text runs at once, the
texts that queue during a run form the next one, bucketed by length so a short lookup is not
padded to a long one.

Runs go as the inference service's do (model/run_width.py): a run alone on every core, runs side
by side on one core each (a run slot per core), at most CPU_RUN_ROWS texts a run. One run at a
time over every core, 32 texts at most, had cost a semantic miss 7.2-8.0 ms of the cache's CPU
at 32 callers (co-located, shared embedding): the encoder costs 5.3-5.9 ms of CPU a text on one
thread and 6.0-7.7 on two (their threads wait for each other at every operator), the loop and
the store the rest. Against it, meshes side by side, 32 callers, 6 alternated rounds of 8 s:
179.2 -> 198.1 rps (median; higher in all six), p50 178.9 -> 162.1 ms, p99 257.1 against 258.8,
the cache's CPU 8.43 -> 7.74 ms a request; a lone lookup still runs on every core.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from hopline.cache.store import EncoderBuildError
from hopline.model.encoder import ENCODER_NAME, build_encoder, encoder_identity
from hopline.model.run_width import CPU_RUN_ROWS, RunWidth, cores
from hopline.model.session import embed_texts, make_session
from hopline.model.spin import Spin
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer
from hopline.observability import metrics
from hopline.runtime.batching import BatchingPolicy, DynamicBatcher

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
    def identity(self) -> str:
        """What a model's head_embedder names when it takes this space's vectors."""
        return encoder_identity(self.digest)

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
    return EmbeddingModel(ENCODER_NAME, _digest(weights_dir / "model.safetensors"), 384)


def encoder_file(
    weights_dir: Path, work_dir: Path, model: EmbeddingModel | None = None
) -> tuple[Path, EmbeddingModel]:
    """The optimised embedding-only encoder for `weights_dir`, building it if missing
    (`model`: `embedding_model(weights_dir)` when the caller has it already)."""
    model = model or embedding_model(weights_dir)
    path = work_dir / "embedders" / f"minilm-{model.digest[:16]}-f{ENCODER_FORMAT}.onnx"
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # weights, not tenants' data
        except OSError as exc:
            raise _unwritable(path.parent, exc) from exc
        _forget_dead_builds(path)
        # Its own name: containers sharing the folder are each pid 1.
        staging = path.with_suffix(f".tmp{os.getpid()}-{secrets.token_hex(4)}")
        log.info("building the embedding encoder", extra={"path": str(path)})
        try:
            build_encoder(weights_dir, staging)
        except Exception as exc:
            # A failed build's half-written file went nowhere: each restart on a full disk
            # left another 63 MB (a resource-exhaustion probe), and the error said
            # "Protobuf serialization failed", not that the disk was full.
            staging.unlink(missing_ok=True)
            if not os.access(path.parent, os.W_OK | os.X_OK):
                raise _unwritable(path.parent, exc) from exc
            free = shutil.disk_usage(path.parent).free
            if free < ENCODER_ROOM_BYTES:
                raise EncoderBuildError(
                    f"building the embedding encoder into {path.parent} failed ({exc}): the "
                    f"disk there has {free >> 20} MiB free and the encoder takes about "
                    f"{ENCODER_ROOM_BYTES >> 20} MiB: free space or point HOPLINE_CACHE_DIR at "
                    "a larger disk"
                ) from exc
            raise
        staging.replace(path)  # atomic: a concurrent reader sees a whole file or none
    return path, model


def _unwritable(folder: Path, exc: Exception) -> EncoderBuildError:
    # A read-only HOPLINE_CACHE_DIR is fine once the encoder is built in it; before that the
    # start failed with a bare "[Errno 13] Permission denied" naming no setting.
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return EncoderBuildError(
        f"the embedding encoder is not built yet and cannot be built in {folder} ({reason}): "
        "make HOPLINE_CACHE_DIR writable for the first start, or point it at a writable "
        f"folder (the encoder takes about {ENCODER_ROOM_BYTES >> 20} MiB there, built once)"
    )


# What building the encoder needs free beside it (the file is about 87 MB).
ENCODER_ROOM_BYTES = 128 << 20


# A staging file untouched this long is no build's in progress (a build writes for seconds):
# one a killed build left, whichever process or container it was.
STALE_BUILD_S = 600.0


def _forget_dead_builds(path: Path) -> None:
    """Half-written encoders of builds killed mid-way."""
    for staging in path.parent.glob(f"{path.stem}.tmp*"):
        try:
            if time.time() - staging.stat().st_mtime > STALE_BUILD_S:
                staging.unlink(missing_ok=True)
        except OSError:
            continue  # gone meanwhile


class Embedder:
    """Unit-length sentence embeddings, batched across concurrent callers.

    `session` runs bulk embedding and, with `narrow` (a one-thread session of the same
    encoder), a batch that runs alone; batches side by side run on `narrow`, `workers` at
    once (0: one per core). Without `narrow`, one batch at a time on `session`.

    One slot per core, not one more as the inference service has (model/run_width.py:
    run_slots): the gateway's misses queue in the co-located inference service's batcher and
    feed a third run, while a third embedder run only splits the texts waiting into smaller runs
    sharing two cores. Four meshes side by side (32 callers, semantic misses, 4 alternated
    rounds of 8 s): one run at a time 179.2 rps (p99 247.6 ms), three slots 199.6 (p99 321.7),
    two 208.2 (p99 230.1), three slots of up to 32 texts 205.8 (p99 331.1).
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        tokenizer: Tokenizer,
        model: EmbeddingModel,
        *,
        narrow: ort.InferenceSession | None = None,
        workers: int = 0,
        max_batch: int = CPU_RUN_ROWS,
        max_queue: int = 4096,
    ) -> None:
        self.session = session
        self.narrow = narrow
        self.tokenizer = tokenizer
        self.model = model
        self.width = RunWidth()
        slots = 1 if narrow is None else (workers or cores())
        self._executor = concurrent.futures.ThreadPoolExecutor(slots, thread_name_prefix="embed")
        self.batcher: DynamicBatcher[str, Vector] = DynamicBatcher(
            self._run,
            BatchingPolicy(max_batch_size=max_batch, max_queue_size=max_queue, max_in_flight=slots),
            self._executor,
            on_queue_depth=metrics.QUEUE_DEPTH.labels("embedder", model.name).set,
            on_batch=metrics.BATCH_SIZE.labels("embedder", model.name).observe,
        )

    @classmethod
    def load(
        cls,
        weights_dir: Path,
        work_dir: Path,
        *,
        threads: int = 0,
        workers: int = 0,
        spin: Spin = Spin.OFF,
        model: EmbeddingModel | None = None,
    ) -> Embedder:
        """threads=0: every core for a batch alone and a one-core session beside it for
        batches side by side, `workers` at once (on one core, a single session); else one
        batch at a time on `threads` threads. `model`: `embedding_model(weights_dir)`, when
        the caller has it already."""
        path, model = encoder_file(weights_dir, work_dir, model)
        tokenizer = load_tokenizer(weights_dir / "tokenizer.json", DEFAULT_MAX_LENGTH)
        try:
            session = make_session(path, threads=threads, spin=spin)
        except Exception as exc:  # whatever ONNX Runtime says of the file
            # The file is built from the weights, so one that does not load (cut short by a
            # full disk, a copy into a volume, a fault) is removed and built again rather
            # than failing every start; one that fails freshly built is a fault to raise.
            log.warning(
                "the built embedding encoder does not load; building it again",
                extra={"path": str(path), "error": str(exc)},
            )
            path.unlink()
            path, model = encoder_file(weights_dir, work_dir)
            session = make_session(path, threads=threads, spin=spin)
        narrow = make_session(path, threads=1) if threads == 0 and cores() > 1 else None
        return cls(session, tokenizer, model, narrow=narrow, workers=workers)

    def _run(self, texts: list[str]) -> list[Vector]:
        if self.narrow is None:
            return list(self.embed_many(texts))
        with self.width.run() as wide:
            session = self.session if wide else self.narrow
            return list(embed_texts(session, self.tokenizer, texts))

    def embed_many(self, texts: Sequence[str], batch_size: int = 64) -> Vector:
        """Blocking bulk embedding (calibration, evaluation); shares the batching code."""
        return embed_texts(self.session, self.tokenizer, texts, batch_size=batch_size)

    async def embed(self, text: str) -> Vector:
        """One text's unit vector; raises QueueFullError past the queue bound."""
        # The bucket only groups similar lengths, so a word count (WordPiece gives a few
        # more tokens than words) spares tokenizing on the event loop as well as in the run.
        vector, _ = await self.batcher.submit(text, 1, len(text.split()) + 2)
        return vector

    async def close(self) -> None:
        await self.batcher.close()
        self._executor.shutdown(wait=True)
