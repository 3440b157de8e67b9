"""Summaries of measured windows: the JSON schema, the table, and the latency CDF plot."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hopline.bench.load import Run, percentiles_ms
from hopline.runtime.cpu_quota import usable_cpus

Describe = Callable[[Any], tuple[str | None, dict[str, float]]]
COMPUTE = "inference.compute"  # the model's own run, as the replies' timings name it


def summarise(run: Run, describe: Describe) -> dict[str, Any]:
    """The per-target record of `--json`: the keys scripts compute ratios from, and more."""
    outcomes: dict[str, int] = {}
    hops: dict[str, list[float]] = {}
    for response in run.responses:  # decoded now, after the window
        outcome, timings = describe(response)
        if outcome is not None:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        for hop, ms in timings.items():
            hops.setdefault(hop, []).append(ms)
    errors = run.errors
    answered = run.answered_ns
    return {
        # Of the requests answered OK; the failed ones are counted in `errors`, apart.
        **percentiles_ms(answered),
        "mean_ms": float(np.mean(answered)) / 1e6 if answered else float("nan"),
        "throughput_rps": len(answered) / run.duration_s if run.duration_s else 0.0,
        "requests": len(answered),
        "errors": sum(errors.values()),
        "errors_by_status": errors,
        "offered_rps": run.offered_rps,
        "latency_growth": run.latency_growth,  # open loop: > MAX_LATENCY_GROWTH, a queue built
        "duration_s": run.duration_s,
        "cache_outcomes": outcomes,
        "hops_ms": {
            hop: {
                "p50": float(np.percentile(v, 50)),
                "p99": float(np.percentile(v, 99)),
                "mean": float(np.mean(v)),
                "count": len(v),  # replies that went through this hop
            }
            for hop, v in hops.items()
        },
        # Share of one core the load generator used in the window (for in-process targets
        # this is the pipeline itself), and how busy the whole machine was.
        "loadgen_cpu_core_share": run.loadgen_cpu_s / run.duration_s if run.duration_s else 0.0,
        "machine_busy": run.machine_busy,
        "cores": usable_cpus(),
        "cpu_ms_per_request": cpu_per_request(run),
    }


def cpu_per_request(run: Run) -> dict[str, float]:
    """CPU ms per request answered: the load generator's process (for an in-process target,
    the pipeline itself) and the whole machine's (every core's busy time: each process of a
    mesh, its children such as milvus-lite, and whatever else ran). Under a closed loop the
    cores are the limit, so two targets' throughputs stand about as the inverse of their
    machine figures. Empty when nothing was answered."""
    if not run.answered:
        return {}
    per = 1e3 / run.answered
    return {
        # /proc/stat's first line is every online core's, whatever this process may run on.
        "machine": run.machine_busy * (os.cpu_count() or 1) * run.duration_s * per,
        "load_generator": run.loadgen_cpu_s * per,
    }


def window_figures(run: Run, describe: Describe | None = None) -> dict[str, float]:
    """One window's own figures, kept beside the pooled record so a comparison can pair each
    round's windows (measured minutes apart at most) instead of pooling drift into both sides.

    With `describe`, also the p50 of each answered request's latency less its own model
    compute (`inference.compute`, where the replies carry it): two meshes are two processes,
    and a model computes up to a tenth faster in one process than in the next for the whole
    of its life on these machines, which a comparison of two meshes' p50s takes in whole."""
    answered = run.answered_ns  # in run.responses' order
    latency = percentiles_ms(answered)
    figures = {
        "throughput_rps": len(answered) / run.duration_s if run.duration_s else 0.0,
        "p50_ms": latency["p50_ms"],
        "p99_ms": latency["p99_ms"],
    }
    if describe is not None:
        less = [
            ns / 1e6 - timings[COMPUTE]
            for ns, response in zip(answered, run.responses, strict=True)
            if COMPUTE in (timings := describe(response)[1])
        ]
        if less:
            figures["p50_less_compute_ms"] = float(np.percentile(less, 50))
    return figures


def without_nan(value: Any) -> Any:
    """`value` with every NaN and infinity (nested in dicts and lists) as None: JSON's null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: without_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_nan(v) for v in value]
    return value


def _over(a: float, b: float) -> float:
    """a / b, NaN where b answered nothing (0 rps, no p50): a peer or a target that answered
    nothing ended the whole run in ZeroDivisionError, every result lost (an operator's
    probe)."""
    return a / b if b and math.isfinite(b) else float("nan")


def ratios(targets: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """The comparisons the performance targets are written against, where both sides ran."""
    out: dict[str, float] = {}
    mesh = targets.get("mesh")
    if mesh is None:
        return out
    echo = targets.get("echo")
    plain = targets.get("inprocess")
    batched = targets.get("inprocess_batched")
    if echo:
        out["mesh_p50_over_echo_p50"] = _over(mesh["p50_ms"], echo["p50_ms"])
    if echo and plain:
        # Miss path: the mesh may cost the in-process pipeline plus a few echo round trips.
        out["mesh_p50_minus_inprocess_in_echo_p50s"] = _over(
            mesh["p50_ms"] - plain["p50_ms"], echo["p50_ms"]
        )
    idle = targets.get("echo_idle")
    if idle and plain:
        # The same in round trips to a callee that was idle, as every hop's is at c=1.
        out["mesh_p50_minus_inprocess_in_echo_idle_p50s"] = _over(
            mesh["p50_ms"] - plain["p50_ms"], idle["p50_ms"]
        )
    if plain:
        out["mesh_p50_over_inprocess_p50"] = _over(mesh["p50_ms"], plain["p50_ms"])
        out["mesh_throughput_over_inprocess"] = _over(
            mesh["throughput_rps"], plain["throughput_rps"]
        )
    if batched:
        out["mesh_throughput_over_inprocess_batched"] = _over(
            mesh["throughput_rps"], batched["throughput_rps"]
        )
        # Latency under the same load: what a request pays for the mesh when both are busy
        # (open loop: both served the same arrivals, so their throughputs match).
        out["mesh_p50_over_inprocess_batched_p50"] = _over(mesh["p50_ms"], batched["p50_ms"])
        out["mesh_p99_over_inprocess_batched_p99"] = _over(mesh["p99_ms"], batched["p99_ms"])
    front_door = targets.get("grpc_batched")
    if front_door:
        # What hopline's own parts cost above a bare gRPC server over the same batcher.
        out["mesh_throughput_over_grpc_batched"] = _over(
            mesh["throughput_rps"], front_door["throughput_rps"]
        )
    out["mesh_p99_over_p50"] = _over(mesh["p99_ms"], mesh["p50_ms"])
    for name, peer in targets.items():
        if name.startswith("peer_"):
            out[f"mesh_throughput_over_{name}"] = _over(
                mesh["throughput_rps"], peer["throughput_rps"]
            )
            out[f"mesh_p99_over_{name}_p99"] = _over(mesh["p99_ms"], peer["p99_ms"])
    return out


def model_ratios(
    targets: Mapping[str, Mapping[str, Any]], compute: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """`--models A,B`: each target's p50 and throughput on B against the same target on A
    (A: the first model given), and B's model compute speed-up at each batch size."""
    out: dict[str, float] = {}
    first: dict[str, Mapping[str, Any]] = {}
    for name, t in targets.items():  # in measuring order: the first model's come first
        base, _, spec = name.partition("@")
        if not spec:
            continue
        if base not in first:
            first[base] = t
            continue
        out[f"{name}_p50_over_first_model"] = _over(t["p50_ms"], first[base]["p50_ms"])
        # In ms: the mesh's saving set against the model's own (compute ... saving_ms).
        out[f"{name}_p50_saving_ms"] = first[base]["p50_ms"] - t["p50_ms"]
        out[f"{name}_throughput_over_first_model"] = _over(
            t["throughput_rps"], first[base]["throughput_rps"]
        )
        # What the model itself saved inside these requests (a run after the request's other
        # work, not back to back as compute alone runs): the saving the p50's is set against.
        here, there = compute_p50(t), compute_p50(first[base])
        if here is not None and there is not None:
            out[f"{name}_inference_compute_saving_ms"] = there - here
    if compute:
        for model, by_batch in list(compute["models"].items())[1:]:
            for batch, v in by_batch.items():
                out[f"compute {model} {batch} speedup"] = v["speedup_over_first"]
                out[f"compute {model} {batch} saving_ms"] = (
                    v["p50_ms"] * v["speedup_over_first"] - v["p50_ms"]
                )
    return out


def compute_p50(target: Mapping[str, Any]) -> float | None:
    """The target's `inference.compute` hop p50 (ms), where its replies carry one."""
    hop = target.get("hops_ms", {}).get(COMPUTE)
    return None if hop is None else float(hop["p50"])


def table(targets: Mapping[str, Mapping[str, Any]]) -> str:
    width = max([18, *(len(name) for name in targets)])
    head = (
        f"{'target':<{width}} {'requests':>8} {'errors':>6} {'rps':>8} {'p50':>8} {'p90':>8} "
        f"{'p99':>8} {'p99.9':>8} {'max':>8}  loadgen CPU"
    )
    lines = [head, "-" * len(head)]
    for name, t in targets.items():
        lines.append(
            f"{name:<{width}} {t['requests']:>8} {t['errors']:>6} {t['throughput_rps']:>8.1f} "
            f"{t['p50_ms']:>8.2f} {t['p90_ms']:>8.2f} {t['p99_ms']:>8.2f} "
            f"{t['p99_9_ms']:>8.2f} {t['max_ms']:>8.2f}  {t['loadgen_cpu_core_share']:.0%} "
            "of a core"
        )
    lines.append("(latencies in ms)")
    for name, t in targets.items():
        if t["errors_by_status"]:
            lines.append(f"{name} errors: {t['errors_by_status']}")
        if t["cache_outcomes"]:
            lines.append(f"{name} cache outcomes: {t['cache_outcomes']}")
        if t["hops_ms"]:
            hops = "  ".join(
                f"{hop} {v['p50']:.2f}/{v['p99']:.2f}" for hop, v in t["hops_ms"].items()
            )
            lines.append(f"{name} hops p50/p99 ms: {hops}")
    return "\n".join(lines)


def write_png(runs: Mapping[str, Run], path: Path, title: str) -> None:
    """Latency CDF per target (log-scaled time), the picture a ratio table hides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, run in runs.items():
        if not run.answered:
            continue
        ms = np.sort(np.asarray(run.answered_ns, dtype=np.float64) / 1e6)
        ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{name} (n={len(ms)})")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("share of requests at or below")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
