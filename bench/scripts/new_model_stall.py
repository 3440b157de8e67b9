"""What a model built while the mesh runs costs the requests of the models it already serves:
a co-located mesh on free ports answers exact repeats of the default model at concurrency 1
while, a few seconds in, a model built into its repository after the mesh started is asked
for the first time. Prints the load's latencies (its max is the stall, if any) and the new
model's first answer's hop timings; `--quiet-run` measures the same load with no new model.

Measured with it (2-vCPU AMD EPYC VM, 12 s windows, runs alternated): the exact repeats' max
94.3 and 117.4 ms while the tokenizer and postprocess looked the new version up on the
gateway's event loop, hashing its files there (the new model's tokenize hop 92-113 ms,
postprocess 64-78), 48.5 and 35.7 ms with ModelRegistry.find and version_digest's larger
steps (tokenize 36-40, postprocess 7-16); a window with no new model (--quiet-run) 11.5 ms.
What is left of the stall is not attributed yet (reading tokenizer.json in the `tokenizers`
library, which may hold the GIL, is the likeliest part).

Usage: python bench/scripts/new_model_stall.py --work DIR [--after-s 5] [--duration 12]
       [--quiet-run]
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
from pathlib import Path

from hopline.bench.cli import bench_once
from hopline.model.build import DEFAULT_MODEL_NAME, DEFAULT_TRAIN_FILE, build_model
from hopline.runtime.launcher import Mesh
from hopline.runtime.service_table import Topology

NEW_MODEL = "stall-probe"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--after-s", type=float, default=5.0)
    parser.add_argument("--duration", default="12")
    parser.add_argument("--quiet-run", action="store_true", help="no new model: the floor")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    repo = args.work / "models"
    if not (repo / DEFAULT_MODEL_NAME / "1").is_dir():
        build_model(DEFAULT_TRAIN_FILE, DEFAULT_MODEL_NAME, repo)
    mesh = Mesh.on_free_ports(repo, args.work, addrs=Topology.COLOCATED.addrs()).start(
        timeout_s=300
    )
    answer: list[str] = []

    def build() -> None:
        # In a process of its own, as from a shell: in this one it would take the load
        # generator's GIL and show up as its latency.
        subprocess.run(
            [sys.executable, "-m", "hopline", "model", "build", "--default",
             "--name", NEW_MODEL, "--repo", str(repo)],
            capture_output=True, check=True,
        )  # fmt: skip

    def first_request() -> None:
        predicted = subprocess.run(
            [sys.executable, "-m", "hopline", "predict", "--gateway", mesh.gateway,
             "--model", NEW_MODEL, "I forgot my password"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        answer.append(predicted.stdout + predicted.stderr)

    # Built before the window (a build takes longer than the window): the mesh sees it on
    # its first request, which is what is measured.
    if not args.quiet_run:
        build()
    side = None if args.quiet_run else threading.Timer(args.after_s, first_request)
    try:
        if side is not None:
            side.start()
        result = bench_once(
            "--target", mesh.gateway, "--concurrency", "1", "--mix", "exact",
            "--baseline", "none", "--duration", args.duration, "--warmup", "1",
            "--model-repo", str(repo),
        )  # fmt: skip
        if side is not None:
            side.join()
    finally:
        mesh.stop()
    figures = result["targets"]["mesh"]
    print(
        f"exact repeats of {DEFAULT_MODEL_NAME}: {figures['requests']} requests, errors "
        f"{figures['errors']}, p50 {figures['p50_ms']:.2f}, p99 {figures['p99_ms']:.2f}, "
        f"max {figures['max_ms']:.2f} ms"
    )
    for line in "".join(answer).splitlines():
        if line.startswith(("model", "cache", "timings")):
            print(f"{NEW_MODEL}'s first answer: {line}")


if __name__ == "__main__":
    main()
