"""cache/embedder.py: the cache's embedder runs as the inference service does (model/run_width.py):
a lookup alone on the every-core session, lookups that arrive together in runs of at most
CPU_RUN_ROWS texts, side by side on one-core sessions, one run slot per core; every text gets
the vector it gets alone.

Stand-in: the sessions load the default model's graph (tests/conftest.py's repository), the
same MiniLM encoder with the classifier head as a second output beside `sentence_embedding`,
so the fast lane does not build the cache's own encoder file (tests/mesh builds and serves it),
but for the one test of what happens to that file when it does not load.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from conftest import BATCH_TEXTS, DEFAULT_MODEL
from hopline.cache.config import CacheConfig
from hopline.cache.embedder import Embedder, EmbeddingModel, encoder_file
from hopline.model.build import default_weights_dir
from hopline.model.repository import ModelRepository
from hopline.model.run_width import CPU_RUN_ROWS, cores
from hopline.model.session import make_session
from hopline.model.tokenizer import load_tokenizer
from hopline.runtime import config as cfg

SPACE = EmbeddingModel("stand-in", "0" * 64, 384)


def _embedder(repo: Path, *, side_by_side: bool, workers: int = 0) -> Embedder:
    config = ModelRepository(repo).resolve(DEFAULT_MODEL)
    graph = config.file("model")
    tokenizer = load_tokenizer(config.file("tokenizer"), config.max_sequence_length)
    narrow = make_session(graph, threads=1) if side_by_side else None
    return Embedder(make_session(graph), tokenizer, SPACE, narrow=narrow, workers=workers)


def _texts(n: int) -> list[str]:
    return [f"{BATCH_TEXTS[i % len(BATCH_TEXTS)]} ({i})" for i in range(n)]


@pytest.mark.skipif(cores() < 2, reason="one core: the embedder keeps a single session")
def test_texts_that_arrive_together_run_side_by_side_and_get_their_own_vectors(
    default_repo: Path,
) -> None:
    embedder = _embedder(default_repo, side_by_side=True)
    texts = _texts(3 * CPU_RUN_ROWS + 5)

    async def scenario() -> tuple[list[np.ndarray], list[np.ndarray]]:
        try:
            alone = [await embedder.embed(t) for t in texts[:4]]
            assert (embedder.width.wide_runs, embedder.width.narrow_runs) == (4, 0)
            together = await asyncio.gather(*(embedder.embed(t) for t in texts))
            return alone, list(together)
        finally:
            await embedder.close()

    alone, together = asyncio.run(scenario())
    assert embedder.batcher.policy.max_batch_size == CPU_RUN_ROWS
    assert embedder.batcher.policy.max_in_flight == cores()  # one slot per core, not one more
    batched = embedder.batcher.batches - 4
    assert batched >= -(-len(texts) // CPU_RUN_ROWS), "a run took more than CPU_RUN_ROWS texts"
    assert embedder.width.narrow_runs > 0, "no run went beside another on the one-core session"
    # Every text's vector is the one it gets alone, whichever session and run it went in.
    reference = embedder.embed_many(texts)
    for i, vector in enumerate(together):
        np.testing.assert_allclose(vector, reference[i], atol=1e-5)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    for i, vector in enumerate(alone):
        np.testing.assert_allclose(vector, reference[i], atol=1e-5)


def test_without_a_narrow_session_one_run_at_a_time(default_repo: Path) -> None:
    embedder = _embedder(default_repo, side_by_side=False)
    assert embedder.batcher.policy.max_in_flight == 1

    async def scenario() -> list[np.ndarray]:
        try:
            return list(await asyncio.gather(*(embedder.embed(t) for t in _texts(20))))
        finally:
            await embedder.close()

    vectors = asyncio.run(scenario())
    assert len(vectors) == 20
    assert (embedder.width.wide_runs, embedder.width.narrow_runs) == (0, 0)  # not consulted


def test_workers_set_the_run_slots(default_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLINE_CACHE_EMBED_WORKERS", "3")
    config = cfg.load(CacheConfig, [])
    assert config.embed_workers == 3
    embedder = _embedder(default_repo, side_by_side=True, workers=config.embed_workers)
    try:
        assert embedder.batcher.policy.max_in_flight == 3
    finally:
        asyncio.run(embedder.close())


def test_a_built_encoder_that_does_not_load_is_built_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache's encoder file is built from the bundled weights into HOPLINE_CACHE_DIR;
    one cut short (a full disk, a copy into a volume) failed every start-up with ONNX
    Runtime's INVALID_PROTOBUF. Builds the real encoder (about 3 s)."""
    weights = default_weights_dir()
    path, _ = encoder_file(weights, tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 3])
    with caplog.at_level(logging.WARNING, logger="hopline.cache.embedder"):
        embedder = Embedder.load(weights, tmp_path, threads=1)
    try:
        assert path.read_bytes() == whole  # the same build again
        warned = [r for r in caplog.records if "does not load" in r.getMessage()]
        assert len(warned) == 1
        vector = asyncio.run(embedder.embed("where is my order"))
        assert np.isclose(np.linalg.norm(vector), 1.0, atol=1e-4)
    finally:
        asyncio.run(embedder.close())
