"""`hopline run` (what `make run` calls): the whole mesh on this machine, until Ctrl-C."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from hopline.runtime.launcher import Mesh, is_serving

log = logging.getLogger("hopline.run")

# Ctrl-C stops every service within this (README: "within 10 s").
STOP_TIMEOUT_S = 8.0


def run_mesh(model_repo: Path, log_format: str = "text", ready_timeout_s: float = 180.0) -> int:
    from hopline.observability.logs import setup_logging

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
    mesh = Mesh(model_repo, env={"HOPLINE_LOG_FORMAT": log_format}, die_with_parent=True)
    mesh.spawn()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not stopping and not is_serving(mesh.gateway):
            if dead := mesh.exited():
                log.error("service exited during start-up", extra={"exit_codes": dead})
                return 1
            if time.monotonic() > deadline:
                log.error("gateway not SERVING in time", extra={"timeout_s": ready_timeout_s})
                return 1
            time.sleep(0.3)
        if not stopping:
            sys.stdout.write(
                f"\nhopline is up: gateway SERVING on {mesh.gateway}\n"
                f'  try: .venv/bin/hopline predict "I forgot my password"\n'
                f"  stop: Ctrl-C\n\n"
            )
            sys.stdout.flush()
        while not stopping:
            if dead := mesh.exited():
                log.error("service exited; stopping the mesh", extra={"exit_codes": dead})
                return 1
            time.sleep(0.3)
        return 0
    finally:
        log.info("stopping the mesh")
        mesh.stop(STOP_TIMEOUT_S)
