"""`hopline run` (what `make run` calls): the whole mesh on this machine, until Ctrl-C.

"hopline is up" means every service answers and the first repeat is an EXACT hit: the
launcher starts the upstreams that run as processes until SERVING, then the gateway (which is
SERVING only once the services it runs in-process are), then waits for its local exact tier
to be live (runtime/launcher.py:Mesh.start says why in that order). The line says how long
start-up took and which services run inside the gateway (`--topology`).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from hopline.runtime.launcher import ALL, Mesh, MeshError, StartInterrupted
from hopline.runtime.service_table import Topology

log = logging.getLogger("hopline.run")

# Ctrl-C stops every service within this (README: "within 10 s").
STOP_TIMEOUT_S = 8.0


# README.md "Placement" has the measurements behind this default.
DEFAULT_TOPOLOGY = Topology.COLOCATED


def run_mesh(
    model_repo: Path,
    log_format: str = "text",
    ready_timeout_s: float = 180.0,
    topology: Topology = DEFAULT_TOPOLOGY,
) -> int:
    from hopline.observability.logs import setup_logging

    started = time.monotonic()
    setup_logging("run", "info", log_format)
    if not model_repo.is_dir():
        log.error("no model repository; run `make model`", extra={"path": str(model_repo)})
        return 2
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # Children share our stdout: their logs are the mesh's log.
    mesh = Mesh(
        model_repo,
        addrs=topology.addrs(),
        env={"HOPLINE_LOG_FORMAT": log_format},
        die_with_parent=True,
    )
    try:
        mesh.start(ALL, ready_timeout_s, stopping=lambda: stopping)
    except StartInterrupted:
        return 0  # start() has stopped what it started
    except MeshError as exc:
        log.error("the mesh did not start", extra={"error": str(exc).splitlines()[0]})
        return 1
    took = time.monotonic() - started
    log.info("mesh ready", extra={"start_up_s": round(took, 1)})
    upstreams = ", ".join(
        f"{name} (in the gateway)" if mesh.colocated(name) else name
        for name in ALL
        if name != "gateway"
    )
    sys.stdout.write(
        f"\nhopline is up in {took:.1f} s: gateway SERVING on {mesh.gateway}, "
        f"{upstreams} SERVING ({topology} topology)\n"
        f'  try: .venv/bin/hopline predict "I forgot my password"\n'
        f"  stop: Ctrl-C\n\n"
    )
    sys.stdout.flush()
    try:
        while not stopping:
            if dead := mesh.exited():
                log.error("service exited; stopping the mesh", extra={"exit_codes": dead})
                return 1
            time.sleep(0.3)
        return 0
    finally:
        log.info("stopping the mesh")
        mesh.stop(STOP_TIMEOUT_S)
