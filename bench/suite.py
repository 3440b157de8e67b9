"""`make bench`: the standard suite, one run, written to bench/results/<date>-<host>.{json,md}.

It starts its own meshes in every topology (fresh cache databases, free ports, so a `make
run` beside them is left alone): `mesh` is five processes, `peer_colocated` the gateway with
the tokenizer, inference and postprocess inside it, `peer_one_process` the cache inside it
too (runtime/service_table.py:Topology). It measures, one scenario after the other:

1. miss, concurrency 1: echo, in-process, the meshes (cache USE, every text new).
2. exact, concurrency 1: echo, the meshes (every text already cached).
3. saturation, concurrency 32, miss: in-process plain and batched, the meshes.
4. open loop at 70% of each mesh's own saturation throughput, and the in-process batched
   pipeline at the same arrivals (latency under the same load).
5. ghz against the five-process gateway's Predict beside `hopline bench` (c=1), taking turns
   (bench/ghz.py).
6. the Ray Serve peer (bench extra), once the meshes are idle: concurrency 32 and open loop
   at the mesh's rps, compared with both meshes at cache BYPASS (the peer has no cache).
7. FP32 against INT8 (bench/precision.py): an INT8 version built beside the default model,
   model compute alone at batch 1 and 32, in-process and mesh miss path, alternated rounds;
   and the bound this CPU's integer GEMM kernel puts on INT8's speed-up (bench/int8_bound.py).
8. Tracing exporting to Jaeger, and to a collector that discards what it gets, against
   sampling nothing in the same mesh (bench/tracing.py; Jaeger switches each mesh's sampling
   between windows), both topologies, miss at concurrency 1 (10 rounds) and 32 (5), alternated
   rounds, each round's exporting window against its own off window.
9. A semantic policy's misses with the cache lookup's embedding shared with the model's head
   against not (bench/shared_embedding.py), co-located, concurrency 1 and 32, alternated.
10. Misses at concurrency 32 through a co-located mesh whose cache is full (prefilled to the
    default model's bound, so every store evicts) against one whose cache is empty
    (bench/full_cache.py), alternated.
11. Where ONNX Runtime runs CUDA (the `gpu` extra on a GPU machine): CPU against CUDA, FP32
    against FP16 and INT8 (bench/providers.py), model compute and the co-located mesh's miss
    path at concurrency 1 and 32; elsewhere the document says why it was not measured.

Scenarios 1-3 take their targets in turn over ROUNDS rounds, the same measured seconds in all.
Scenarios 1 and 3 also read every mesh's Prometheus endpoints around its windows: per hop, the
gateway's time against the server's own, and the time a request spends outside the gateway
(bench/hop_split.py), in the report's per-hop tables, and each process's CPU per request
beside every target's machine CPU per request (at 32 callers the cores are the limit, so the
throughput ratios are ratios of these).
Each target is measured alone; targets share the 2 cores, so nothing runs beside them (the
idle mesh waits with no traffic).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hopline.bench import machine
from hopline.bench.cli import bench_once as bench
from hopline.bench.full_cache import full_cache_scenario
from hopline.bench.ghz import GHZ_DEFAULT, ghz_beside_bench
from hopline.bench.mixes import make_mix
from hopline.bench.precision import precision_scenario
from hopline.bench.providers import cuda_unavailable, providers_scenario
from hopline.bench.report import ratios
from hopline.bench.shared_embedding import shared_embedding_scenario
from hopline.bench.suite_report import COLOCATED, ONE_PROCESS, check_targets, markdown
from hopline.bench.tracing import tracing_scenario
from hopline.cli.outputs import output_problem
from hopline.model.build import DEFAULT_CHECK_SENTENCES
from hopline.runtime.cpu_quota import usable_cpus
from hopline.runtime.launcher import Mesh, MeshError
from hopline.runtime.ports import free_ports
from hopline.runtime.service_table import Topology

ROUNDS = 3

ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPT = ROOT / "bench" / "peers" / "ray_serve.py"


def start_peer(model_repo: Path) -> tuple[subprocess.Popen[str], str]:
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(PEER_SCRIPT),
            "--grpc-port",
            str(port),
            "--model-repo",
            str(model_repo),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the Ray Serve peer did not start (said {line!r})")
    return proc, line.split()[1]


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    common = [
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--model-repo",
        str(args.model_repo),
    ]
    doc: dict[str, Any] = {
        "hopline_bench_suite": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cores": usable_cpus(),
        "machine": machine.describe(),
        "scenarios": {},
    }
    sc = doc["scenarios"]
    work = Path(tempfile.mkdtemp(prefix="hopline-bench-"))
    meshes: list[Mesh] = []
    try:
        # In the order the names below unpack them: five processes, co-located, one process.
        for topology in (Topology.FIVE_PROCESS, Topology.COLOCATED, Topology.ONE_PROCESS):
            (work / topology).mkdir()
            # Metrics stay on (free ports): the meshes measured are the ones operators run.
            mesh = Mesh.on_free_ports(args.model_repo, work / topology, addrs=topology.addrs())
            meshes.append(mesh)
            mesh.start(timeout_s=180.0)
    except MeshError as exc:
        for mesh in meshes:
            mesh.stop()
        raise SystemExit(f"mesh did not start; logs in {work}: {exc}") from exc
    gw, colo, one = (m.addrs["gateway"] for m in meshes)
    common_peer = [*common, "--peer", f"{COLOCATED}={colo}", "--peer", f"{ONE_PROCESS}={one}"]
    # Where each mesh's time goes per hop (bench/hop_split.py), read from its processes.
    split = [
        f"--metrics={name}={','.join(mesh.metrics_endpoints())}"
        for name, mesh in zip(("mesh", COLOCATED, ONE_PROCESS), meshes, strict=True)
    ]
    # The c=1 and c=32 scenarios' targets take turns, ROUNDS windows each, so a slow minute
    # on a shared machine hits each target alike (argparse keeps the last --duration).
    alternated = [
        *common_peer,
        "--rounds",
        str(ROUNDS),
        "--duration",
        f"{args.duration / ROUNDS:g}",
    ]
    try:
        sc["miss_c1"] = bench(
            "--target",
            gw,
            "--concurrency",
            "1",
            "--mix",
            "miss",
            "--baseline",
            # grpc_batched: what any Python gRPC server over the same batcher adds at c=1;
            # inprocess_batched: what the batcher itself adds, without gRPC.
            "echo,echo_idle,inprocess,inprocess_batched,grpc_batched",
            *alternated,
            *split,
        )
        sc["exact_c1"] = bench(
            "--target",
            gw,
            "--concurrency",
            "1",
            "--mix",
            "exact",
            "--baseline",
            "echo",
            *alternated,
        )
        sc["miss_c32"] = bench(
            "--target",
            gw,
            "--concurrency",
            "32",
            "--mix",
            "miss",
            "--baseline",
            "inprocess,inprocess_batched,grpc_batched",
            *alternated,
            *split,
        )
        saturation = sc["miss_c32"]["targets"]
        for key, target, name in (
            ("miss_open70", gw, "mesh"),
            (f"miss_open70_{COLOCATED}", colo, f"peer_{COLOCATED}"),
            (f"miss_open70_{ONE_PROCESS}", one, f"peer_{ONE_PROCESS}"),
        ):
            rps = 0.7 * saturation[name]["throughput_rps"]
            # The in-process batched pipeline at the same arrivals: the latency the mesh
            # adds when both are under load, not only at rest (c=1) or flat out (c=32).
            sc[key] = bench(
                "--target",
                target,
                "--rps",
                f"{rps:.1f}",
                "--mix",
                "miss",
                "--baseline",
                "inprocess_batched",
                *common,
            )
        if args.ghz.is_file():
            texts = [make_mix("exact").text(i) for i in range(64)]
            for key, cache in (("ghz_exact_c1", "use"), ("ghz_bypass_c1", "bypass")):

                def bench_window(seconds: float, cache: str = cache) -> dict[str, Any]:
                    figures: dict[str, Any] = bench(
                        "--target",
                        gw,
                        "--concurrency",
                        "1",
                        "--mix",
                        "exact",
                        "--cache",
                        cache,
                        "--baseline",
                        "none",
                        *common,
                        "--duration",
                        f"{seconds:g}",
                    )["targets"]["mesh"]
                    return figures

                sc[key] = ghz_beside_bench(
                    args.ghz, gw, texts, cache, args.duration, ROUNDS, bench_window
                )
        else:
            doc["ghz_missing"] = f"{args.ghz} not found (make bench installs it)"
        if args.peer:
            sc["peer_c32"] = bench(
                "--target",
                gw,
                "--concurrency",
                "32",
                "--mix",
                "miss",
                "--cache",
                "bypass",
                "--baseline",
                "none",
                *common_peer,
            )
            mesh_rps = 0.7 * sc["peer_c32"]["targets"]["mesh"]["throughput_rps"]
            sc["peer_open"] = bench(
                "--target",
                gw,
                "--rps",
                f"{mesh_rps:.1f}",
                "--mix",
                "miss",
                "--cache",
                "bypass",
                "--baseline",
                "none",
                *common_peer,
            )
    finally:
        for mesh in meshes:
            mesh.stop()
    if args.peer:
        # The peer runs with the mesh stopped: the two never share the cores.
        proc, addr = start_peer(args.model_repo)
        try:
            for key in ("peer_c32", "peer_open"):
                argv = sc[key]["argv"]
                run = bench(
                    *argv[: argv.index("--baseline")],
                    "--baseline",
                    "none",
                    "--target",
                    "none",
                    "--peer",
                    f"ray={addr}",
                    *common,
                )
                sc[key]["targets"]["peer_ray"] = run["targets"]["peer_ray"]
                sc[key]["ratios"] = ratios(sc[key]["targets"])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    # Issue 16: FP32 against INT8 on a mesh of its own, once the others have stopped.
    sc["precision_ab"] = precision_scenario(args.model_repo, work / "precision")
    sc.update(tracing_scenario(args.model_repo, work / "tracing"))
    sc.update(shared_embedding_scenario(args.model_repo, work / "shared-embedding"))
    sc.update(full_cache_scenario(args.model_repo, work / "full-cache"))
    if why := cuda_unavailable():
        doc["not_measured"] = {"gpu_providers": why}
    else:
        reference = DEFAULT_CHECK_SENTENCES if DEFAULT_CHECK_SENTENCES.is_file() else None
        sc["gpu_providers"] = providers_scenario(
            work / "gpu", reference, int8=True, concurrency=(1, 32)
        )
    shutil.rmtree(work, ignore_errors=True)
    doc["targets_met"] = check_targets(sc)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hopline.bench.suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument(
        "--model-repo",
        type=Path,
        default=Path(os.environ.get("HOPLINE_MODEL_REPO", ROOT / "models")),
    )
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--ghz", type=Path, default=GHZ_DEFAULT)
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip Ray Serve")
    args = p.parse_args(argv)
    if (problem := output_problem(args.out, "--out", directory=True)) is not None:
        p.error(problem)
    if args.peer and importlib.util.find_spec("ray") is None:
        raise SystemExit("the Ray Serve peer needs the bench extra: pip install -e '.[bench]'")
    doc = run_suite(args)
    stem = f"{dt.date.today().isoformat()}-{doc['host']}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    summary = markdown(doc)
    (args.out / f"{stem}.md").write_text(summary)
    sys.stdout.write(summary)
    sys.stdout.write(f"\nwrote {args.out / stem}.json and .md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
