"""services/inference/backend.py:SideBySideBackend: a run alone takes the session with every
core, a run that starts while another is in progress takes the one-core session, and both
answer the same; while recent runs had company, a run alone takes one core too. Real ONNX
Runtime sessions of the default model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from conftest import BATCH_TEXTS, DEFAULT_MODEL
from hopline.model.repository import load_config
from hopline.model.run_width import COMPANY_WINDOW, NARROW_FROM, cores, run_slots
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.services.inference.backend import (
    Array,
    OnnxRuntimeBackend,
    SideBySideBackend,
    create_backend,
    warm_up,
)


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
    assert (backend.width.wide_runs, backend.width.narrow_runs) == (1, 0)

    first = threading.Thread(target=backend.run, args=(long, []))
    first.start()
    deadline = time.monotonic() + 10
    while backend.width.wide_runs < 2:  # the long run has started, on the wide session
        assert time.monotonic() < deadline, "the first run never started"
        time.sleep(0.001)
    beside = backend.run(short, [])
    still_running = first.is_alive()
    first.join()
    assert still_running, "the long run ended before the second began: nothing was beside it"
    assert (backend.width.wide_runs, backend.width.narrow_runs) == (2, 1)
    for name, values in alone.items():
        np.testing.assert_allclose(
            np.asarray(beside[name], np.float64), np.asarray(values, np.float64), atol=1e-5
        )

    backend.run(short, [])  # alone again: every core
    assert (backend.width.wide_runs, backend.width.narrow_runs) == (3, 1)


def test_threads_zero_on_the_cpu_is_side_by_side(default_repo: Path) -> None:
    """On one core there is nothing to split: one session then."""
    cfg = load_config(default_repo / DEFAULT_MODEL / "1")
    chosen = create_backend(cfg, 0)
    assert isinstance(chosen, SideBySideBackend) is (cores() > 1)
    warm_up(chosen)  # every session it keeps, without counting as runs
    if isinstance(chosen, SideBySideBackend):
        assert (chosen.width.wide_runs, chosen.width.narrow_runs) == (0, 0)
    fixed = create_backend(cfg, 1)
    assert isinstance(fixed, OnnxRuntimeBackend)
    assert run_slots(0) == cores() + 1  # one more than the cores: see run_slots
    assert run_slots(3) == 3


def test_a_run_alone_takes_one_core_while_recent_runs_had_company(default_repo: Path) -> None:
    """Under load a run that happens to start alone is soon joined, and a wide run with
    company is the slowest kind: it takes the one-core session until runs are alone again."""
    backend = SideBySideBackend(load_config(default_repo / DEFAULT_MODEL / "1"))
    long, short = _inputs(default_repo, 32), _inputs(default_repo, 1)
    for _ in range(3):  # a closed loop of one never has company
        backend.run(short, [])
    width = backend.width
    assert (width.wide_runs, width.narrow_runs, width.company) == (3, 0, 0.0)

    first = threading.Thread(target=backend.run, args=(long, []))
    first.start()
    deadline = time.monotonic() + 10
    while backend.width.wide_runs < 4:
        assert time.monotonic() < deadline, "the long run never started"
        time.sleep(0.001)
    beside = 0
    while beside < 12 and first.is_alive():
        backend.run(short, [])
        beside += 1
    first.join()
    assert beside == 12, f"the long run ended after {beside} runs beside it"
    # 13 runs with company in a row (the long one and the 12 beside it).
    assert backend.width.company >= NARROW_FROM

    backend.run(short, [])  # alone, but runs have just had company: one core
    assert (backend.width.wide_runs, backend.width.narrow_runs) == (4, 13)
    alone = 0
    while backend.width.company >= NARROW_FROM:  # alone again: the share falls run by run
        backend.run(short, [])
        alone += 1
        assert alone <= 4 * COMPANY_WINDOW, "runs alone never brought the wide session back"
    backend.run(short, [])
    assert backend.width.wide_runs == 5
