"""A service started under a low soft limit on file descriptors (a container runtime's 1,024;
here 256) runs with its hard limit (runtime/fd_limit.py), and its "listening" line says the
limit it has. A real postprocess process, started under a soft limit of 256 by util-linux's
`prlimit`."""

from __future__ import annotations

import json
import resource
from pathlib import Path

from harness import Mesh, free_port, spawn_replica

LOW = 256


def _soft_and_hard(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


def test_a_service_raises_its_soft_fd_limit_to_the_hard_one(
    default_repo: Path, tmp_path: Path
) -> None:
    mesh = Mesh(default_repo, tmp_path)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard > LOW, "this machine's hard limit leaves nothing to raise"
    # The service's own limit, set as it starts (util-linux's prlimit execs it): not this
    # process's, which may hold more than LOW descriptors already.
    proc = spawn_replica(
        mesh,
        "postprocess",
        free_port(),
        0,
        {"HOPLINE_LOG_FORMAT": "json"},
        "fds",
        prefix=("prlimit", f"--nofile={LOW}:{hard}"),
    )
    try:
        assert _soft_and_hard(proc.pid) == (hard, hard)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = (tmp_path / "postprocess-fds.log").read_text().splitlines()
    [listening] = [r for r in map(json.loads, lines) if r.get("msg") == "listening"]
    assert listening["fd_limit"] == hard
