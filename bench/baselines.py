"""The baselines `hopline bench` measures a mesh against, and their servers: the echo and
front-door servers it starts (`python -m MODULE`, bench/echo.py, bench/front_door.py), the
in-process pipeline in the inference service's settings, and the model's compute alone."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hopline.bench.mixes import make_mix
from hopline.bench.targets import InProcessTarget, inprocess_threads
from hopline.runtime.cpu_quota import usable_cpus
from hopline.runtime.parent import LAUNCHER_ENV

if TYPE_CHECKING:
    from hopline.model.repository import ModelConfig


def start_server(module: str, *args: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """A baseline's server (`python -m MODULE --listen ADDR ARGS`, which says `READY LOOP`
    once it answers): its process, address and the loop that runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--listen", address, *args],
        stdout=subprocess.PIPE,
        env={**os.environ, LAUNCHER_ENV: str(os.getpid())},  # it ends with the bench
    )
    assert proc.stdout is not None
    said = proc.stdout.readline().decode().split()
    if not said or said[0] != "READY":
        proc.kill()
        proc.wait()
        raise SystemExit(f"{module} did not start (said {' '.join(said)!r})")
    return proc, address, said[1] if len(said) > 1 else ""


def start_echo() -> tuple[subprocess.Popen[bytes], str, str]:
    """The echo server on the services' event loop (bench/echo.py)."""
    return start_server("hopline.bench.echo")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()  # the READY pipe


def model_spec(spec: str) -> tuple[str, str]:
    name, _, version = spec.partition(":")
    return name, version


def inprocess_config(args: argparse.Namespace, spec: str = "") -> ModelConfig:
    """The model an in-process baseline loads for `spec` (NAME[:VERSION]; empty: --model, else
    the default model); ModelNotFoundError when --model-repo has no such model or version."""
    from hopline.model.repository import ModelRepository

    model, version = model_spec(spec) if spec else (args.model, "")
    model = model or os.environ.get("HOPLINE_DEFAULT_MODEL", "support-intents")
    return ModelRepository(Path(args.model_repo)).resolve(model, version)


def inprocess_target(name: str, args: argparse.Namespace, spec: str = "") -> InProcessTarget:
    """`inprocess` or `inprocess_batched` for `spec` (NAME[:VERSION]; empty: --model), with
    the inference service's settings from this environment."""
    from hopline.model.run_width import run_slots
    from hopline.runtime import config as cfg
    from hopline.services.inference.service import InferenceConfig

    config = inprocess_config(args, spec)
    suffix = f"@{spec}" if spec else ""
    service = cfg.load(InferenceConfig, [])  # the inference service's settings, from env
    if name == "inprocess":
        workers, threads = inprocess_threads(args.concurrency or (usable_cpus() if args.rps else 1))
        return InProcessTarget(
            config,
            batched=False,
            workers=workers,
            threads=threads,
            spin=service.spin,
            nice=service.nice,
            slice_us=service.slice_us,
            suffix=suffix,
        )
    return InProcessTarget(
        config,
        batched=True,
        workers=run_slots(service.workers),
        threads=service.threads,
        spin=service.spin,
        nice=service.nice,
        slice_us=service.slice_us,
        suffix=suffix,
    )


def compute(args: argparse.Namespace, specs: list[str]) -> dict[str, Any]:
    from hopline.bench.compute import compare_compute, compute_table
    from hopline.model.repository import ModelRepository
    from hopline.runtime import config as cfg
    from hopline.services.inference.service import InferenceConfig

    repo = ModelRepository(Path(args.model_repo))
    configs = [repo.resolve(*model_spec(spec)) for spec in specs]
    mix = make_mix("miss", args.clinc)
    service = cfg.load(InferenceConfig, [])  # run as the inference service runs them
    sys.stderr.write(f"measuring model compute ({', '.join(specs)}) ...\n")
    result = compare_compute(
        configs,
        [mix.text(i) for i in range(512)],
        batches=args.compute_batches,  # checked and defaulted before any window
        iterations=args.compute_iterations,
        threads=service.threads,
        spin=service.spin,
    )
    sys.stdout.write(compute_table(result) + "\n")
    return result
