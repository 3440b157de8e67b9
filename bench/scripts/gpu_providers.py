"""CPU against CUDA (and TensorRT where its libraries load), FP32 against FP16, on a GPU machine
(bench/providers.py says what it builds and measures; `make bench` runs the same where CUDA
runs). Run where the `gpu` extra is installed (onnxruntime-gpu; tensorrt for TensorRT).

Usage: python bench/scripts/gpu_providers.py --work DIR [--reference minilm_reference.json]
       [--iterations 200] [--batches 1,32,128] [--int8] [--mesh] [--concurrency 1,32]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hopline.bench.compute import compute_table
from hopline.bench.providers import providers_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    doc = providers_scenario(
        args.work,
        args.reference,
        int8=args.int8,
        batches=[int(b) for b in args.batches.split(",")],
        iterations=args.iterations,
        concurrency=[int(c) for c in args.concurrency.split(",")] if args.mesh else [],
        duration_s=args.duration,
    )
    print(json.dumps(doc["environment"]))
    print(json.dumps(doc["agreement"], indent=1))
    print(compute_table(doc["compute"]))
    for name, t in doc.get("targets", {}).items():
        print(
            f"{name:<36} p50 {t['p50_ms']:.2f} p99 {t['p99_ms']:.2f} ms "
            f"{t['throughput_rps']:.1f} rps errors {t['errors']}"
        )
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
