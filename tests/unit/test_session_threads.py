"""How many intra-op threads a session gets when none are asked for, and that none of them is
pinned (model/session.py:pool_size): ONNX Runtime's own default pins each pool thread to a
core, where it waits behind the thread that calls `run` whenever the two share that core."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import DEFAULT_MODEL
from hopline.model.repository import ModelRepository
from hopline.model.session import make_session, pool_size
from hopline.runtime.cpu_quota import physical_cores, usable_cpus


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def test_a_default_session_leaves_its_pool_threads_free_to_move(default_repo: Path) -> None:
    """Real: the model's session with threads=0; the threads it starts may run on every CPU
    this process may use. On a machine of one core there is no pool thread to look at, and the
    test says so rather than pass on nothing."""
    model = ModelRepository(default_repo).resolve(DEFAULT_MODEL).file("model")
    before = _threads()
    session = make_session(model, threads=0)
    started = _threads() - before
    process = os.sched_getaffinity(0)
    cores = physical_cores()
    assert len(started) >= cores - 1, f"{len(started)} threads for a pool of {cores}"
    if cores == 1:
        print("one core: ONNX Runtime starts no pool thread, nothing to check")
    allowed = {tid: os.sched_getaffinity(tid) for tid in started}
    pinned = {tid: sorted(cpus) for tid, cpus in allowed.items() if cpus != process}
    assert not pinned, f"pool threads pinned (process may use {sorted(process)}): {pinned}"
    del session


def test_the_pool_is_a_thread_per_physical_core(tmp_path: Path) -> None:
    """Two hyperthreads of one core count once; an explicit count is kept."""
    cpus = sorted(os.sched_getaffinity(0))
    for index, cpu in enumerate(cpus):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{index // 2}\n")
    assert physical_cores(tmp_path) == min((len(cpus) + 1) // 2, usable_cpus())
    unreadable = tmp_path / "none"
    assert physical_cores(unreadable) == min(len(cpus), usable_cpus())
    assert pool_size(3) == 3
    assert pool_size(0) == physical_cores()
