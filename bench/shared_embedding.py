"""Semantic misses with the lookup's embedding shared against not (`make bench`'s
`semantic_miss_c1` / `_c32`, bench/scripts/share_embedding_ab.py).

A scratch repository holds the default model with its cache policy set to `semantic` at
threshold 1.0, so every lookup embeds and searches and only an identical vector hits (the
miss mix's texts are templated: a lower threshold would turn misses into hits). Two
co-located meshes serve it, one with `HOPLINE_GATEWAY_SHARE_EMBEDDINGS=true` (the model's head
runs on the lookup's query embedding) and one with `false` (tokens, the whole model, and
speculation beside the lookup's own encoder run); `hopline bench --mix miss` measures both as
target and peer with alternated rounds, at concurrency 1 against echo and in-process and at 32
against the in-process batched pipeline.

The lookup budget is raised for both meshes (`BUDGET_MS`): at the default 40 ms a 2-core
machine's semantic lookups overrun under 32 callers and fail open, and both meshes then
measure the token path. The scenario reports the share of misses each mesh answered through
the shared embedding, so a run where it was not taken cannot pass for one where it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hopline.bench.cli import bench_once
from hopline.runtime.launcher import Mesh
from hopline.runtime.service_table import Topology

MODEL = "support-intents"
THRESHOLD = 1.0
BUDGET_MS = 2000.0
SHARED, UNSHARED = "shared", "unshared"


def semantic_repo(source: Path, work: Path, threshold: float = THRESHOLD) -> Path:
    """The default model's version 1 with a `semantic` policy, in a scratch repository."""
    repo = work / "models"
    target = repo / MODEL / "1"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(source / MODEL / "1", target)
    cfg = json.loads((target / "config.json").read_text())
    if not cfg.get("head_embedder"):
        raise SystemExit(f"{source}'s {MODEL} has no head: rebuild it (`rm -r models; make model`)")
    cfg["cache"].update(mode="semantic", threshold=threshold)
    (target / "config.json").write_text(json.dumps(cfg))
    return repo


@contextlib.contextmanager
def colocated_meshes(
    repo: Path,
    work: Path,
    envs: Mapping[str, Mapping[str, str]],
    topology: Topology = Topology.COLOCATED,
) -> Iterator[dict[str, Mesh]]:
    """One mesh over `repo` per entry of `envs` (its name and extra environment), co-located
    unless `topology` says otherwise, each in `work/<name>`, all stopped on exit."""
    meshes: dict[str, Mesh] = {}
    try:
        for name, env in envs.items():
            (work / name).mkdir(exist_ok=True)
            meshes[name] = Mesh.on_free_ports(
                repo, work / name, addrs=topology.addrs(), env=dict(env)
            ).start(timeout_s=180.0)
        yield meshes
    finally:
        for mesh in meshes.values():
            mesh.stop()


def add_ab_load_arguments(parser: argparse.ArgumentParser, rounds: int, duration_s: float) -> None:
    """The load options of a script that compares meshes side by side: closed loop
    (--concurrency) or open loop (--rps), alternated rounds and their total duration."""
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=32)
    load.add_argument("--rps", type=float)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--duration", type=float, default=duration_s)


def alternated_misses(
    meshes: Mapping[str, Mesh], repo: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """`hopline bench --mix miss` through every mesh, the first as target and the rest as
    peers, in alternated rounds with the load `add_ab_load_arguments` parsed into `args`."""
    names = list(meshes)
    peers = [a for n in names[1:] for a in ("--peer", f"{n}={meshes[n].gateway}")]
    load = ["--rps", f"{args.rps:g}"] if args.rps else ["--concurrency", f"{args.concurrency}"]
    return bench_once(
        *("--target", meshes[names[0]].gateway, *peers, *load),
        *("--mix", "miss", "--baseline", "none", "--model-repo", str(repo)),
        *("--rounds", str(args.rounds), "--duration", f"{args.duration:g}"),
    )


def paired_windows(
    target: Mesh,
    peer: tuple[str, Mesh],
    repo: Path,
    rounds: int,
    duration_s: float,
    warmup_s: float,
) -> list[str]:
    """`hopline bench` arguments for misses through `target` (reported as `mesh`) and a peer
    mesh (`peer_NAME`), taking turns over `rounds` windows that add up to `duration_s`."""
    name, other = peer
    return [
        "--target",
        target.gateway,
        "--peer",
        f"{name}={other.gateway}",
        "--mix",
        "miss",
        "--model-repo",
        str(repo),
        "--rounds",
        str(rounds),
        "--duration",
        f"{duration_s / rounds:g}",
        "--warmup",
        f"{warmup_s:g}",
    ]


def shared_embedding_scenario(
    model_repo: Path,
    work: Path,
    *,
    rounds: int = 3,
    duration_s: float = 12.0,
    warmup_s: float = 3.0,
    budget_ms: float = BUDGET_MS,
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    repo = semantic_repo(model_repo, work)
    budget = {"HOPLINE_CACHE_BUDGET_MS": f"{budget_ms:g}"}
    envs = {
        SHARED: {"HOPLINE_GATEWAY_SHARE_EMBEDDINGS": "true", **budget},
        UNSHARED: {"HOPLINE_GATEWAY_SHARE_EMBEDDINGS": "false", **budget},
    }
    with colocated_meshes(repo, work, envs) as meshes:
        common = paired_windows(
            meshes[SHARED], (UNSHARED, meshes[UNSHARED]), repo, rounds, duration_s, warmup_s
        )
        sc = {
            "semantic_miss_c1": bench_once(
                *common, "--concurrency", "1", "--baseline", "echo,inprocess"
            ),
            "semantic_miss_c32": bench_once(
                *common, "--concurrency", "32", "--baseline", "inprocess_batched"
            ),
        }
    for result in sc.values():
        result["shared_share"] = {
            name: shared_share(target) for name, target in result["targets"].items()
        }
    return sc


def shared_share(target: dict[str, Any]) -> float:
    """Share of a mesh's misses answered with no tokenize hop (the model's head on the
    lookup's embedding); 0 for a baseline, which reports no hops."""
    misses = int((target.get("cache_outcomes") or {}).get("miss", 0))
    if not misses or not target.get("hops_ms"):
        return 0.0
    tokenized = int(target["hops_ms"].get("tokenize", {}).get("count", 0))
    return max(0.0, 1.0 - tokenized / misses)


def shared_embedding_targets(sc: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the suite's table: the shared mesh no worse than the unshared one (p50 at c=1,
    rps at 32), and only when it really answered its misses from the lookup's embedding."""
    rows: list[dict[str, Any]] = []
    peer = f"peer_{UNSHARED}"
    for key, figure, better in (
        ("semantic_miss_c1", "p50_ms", "lower"),
        ("semantic_miss_c32", "throughput_rps", "higher"),
    ):
        if key not in sc:
            continue
        t, share = sc[key]["targets"], sc[key]["shared_share"]
        shared, unshared = t["mesh"][figure], t[peer][figure]
        value = unshared / shared if better == "lower" else shared / unshared
        taken = share["mesh"] >= 0.95 and share[peer] == 0.0
        how = f"ratio ({figure}: {shared:.2f} shared vs {unshared:.2f} not)"
        rows.append(
            {
                "target": f"{key}: shared embedding vs not, {figure} ({better} is better)",
                "value": value,
                "limit": 1.0,
                "met": value >= 1.0 and taken,
                "how": how if taken else f"{how}; THE SHARED PATH WAS NOT TAKEN ({share})",
            }
        )
    return rows
