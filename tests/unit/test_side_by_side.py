"""services/inference/backend.py:SideBySideBackend: a run alone takes the session with every
core, a run that starts while another is in progress takes the one-core session, and both
answer the same. Real ONNX Runtime sessions of the default model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from conftest import BATCH_TEXTS, DEFAULT_MODEL
from hopline.model.repository import load_config
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.services.inference.backend import (
    Array,
    OnnxRuntimeBackend,
    SideBySideBackend,
    cores,
    create_backend,
    warm_up,
)
from hopline.services.inference.service import run_slots


def _inputs(repo: Path, rows: int) -> dict[str, Array]:
    cfg = load_config(repo / DEFAULT_MODEL / "1")
    tokenizer = load_tokenizer(cfg.file("tokenizer"), cfg.max_sequence_length)
    texts = (BATCH_TEXTS * rows)[:rows]
    batch = encode(tokenizer, [t * 8 for t in texts])  # long rows: a run of a few 100 ms
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}


def test_a_run_beside_another_takes_the_one_core_session(default_repo: Path) -> None:
    backend = SideBySideBackend(load_config(default_repo / DEFAULT_MODEL / "1"))
    assert backend.narrow.session.get_session_options().intra_op_num_threads == 1
    long, short = _inputs(default_repo, 32), _inputs(default_repo, 1)
    alone = backend.run(short, [])
    assert (backend.wide_runs, backend.narrow_runs) == (1, 0)

    first = threading.Thread(target=backend.run, args=(long, []))
    first.start()
    deadline = time.monotonic() + 10
    while backend.wide_runs < 2:  # the long run has started, on the wide session
        assert time.monotonic() < deadline, "the first run never started"
        time.sleep(0.001)
    beside = backend.run(short, [])
    still_running = first.is_alive()
    first.join()
    assert still_running, "the long run ended before the second began: nothing was beside it"
    assert (backend.wide_runs, backend.narrow_runs) == (2, 1)
    for name, values in alone.items():
        np.testing.assert_allclose(
            np.asarray(beside[name], np.float64), np.asarray(values, np.float64), atol=1e-5
        )

    backend.run(short, [])  # alone again: every core
    assert (backend.wide_runs, backend.narrow_runs) == (3, 1)


def test_threads_zero_on_the_cpu_is_side_by_side(default_repo: Path) -> None:
    """On one core there is nothing to split: one session then."""
    cfg = load_config(default_repo / DEFAULT_MODEL / "1")
    chosen = create_backend(cfg, 0)
    assert isinstance(chosen, SideBySideBackend) is (cores() > 1)
    warm_up(chosen)  # every session it keeps, without counting as runs
    if isinstance(chosen, SideBySideBackend):
        assert (chosen.wide_runs, chosen.narrow_runs) == (0, 0)
    fixed = create_backend(cfg, 1)
    assert isinstance(fixed, OnnxRuntimeBackend)
    assert run_slots(0) == cores() + 1  # one more than the cores: see run_slots
    assert run_slots(3) == 3
