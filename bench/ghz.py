"""ghz, the external check on `hopline bench`'s latencies: both measure one gateway's Predict
at concurrency 1, taking turns, and `make bench` compares their p50s (suite.py, scenario 5).

On a shared machine a single window of each was not a comparison: one window's ghz p50 ranged
from 1.01 to 1.52 ms between runs (stop 32), and the suite's one-window rows disagreed by 14-25%
where four alternated rounds agreed within 3%. So the two take `rounds` turns of equal length,
the order swapped every round (ghz first, then `hopline bench` first, ...), and each side is
reported by its median round (by p50), with every round's p50 beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GHZ_DEFAULT = ROOT / ".tools" / "bin" / "ghz"
METHOD = "hopline.gateway.v1.GatewayService.Predict"
# The .proto files rather than reflection: they work with HOPLINE_REFLECTION=false too (until
# stop 94 reflection also found no method by its full name: runtime/reflection.py).
PROTO = (
    "--proto",
    str(ROOT / "protos/hopline/gateway/v1/gateway.proto"),
    "--import-paths",
    str(ROOT / "protos"),
)
CACHE_MODES = {"use": "CACHE_MODE_USE", "bypass": "CACHE_MODE_BYPASS"}


def _ghz_call(binary: Path) -> list[str]:
    return [str(binary), "--insecure", *PROTO, "--call", METHOD]


def warm(binary: Path, gateway: str, texts: Sequence[str]) -> None:
    """Each text sent once, so the exact mix's texts are cached before any window."""
    for text in texts:
        subprocess.run(
            [*_ghz_call(binary), "-d", json.dumps({"text": text}), "-n", "1", "-c", "1", gateway],
            check=True,
            capture_output=True,
        )


def ghz(
    binary: Path, gateway: str, texts: Sequence[str], cache: str, seconds: float
) -> dict[str, Any]:
    """One ghz window: round-robin over `texts`, one connection, concurrency 1."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as data:
        json.dump([{"text": t, "cacheMode": CACHE_MODES[cache]} for t in texts], data)
    try:
        out = subprocess.run(
            [
                *_ghz_call(binary),
                *("-D", data.name, "-c", "1", "--connections", "1", "-z", f"{seconds}s"),
                *("--format", "json", gateway),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(data.name)
    report = json.loads(out.stdout)
    dist = {int(d["percentage"]): d["latency"] / 1e6 for d in report["latencyDistribution"]}
    return {
        "p50_ms": dist[50],
        "p90_ms": dist[90],
        "p99_ms": dist[99],
        "throughput_rps": report["rps"],
        "requests": report["count"],
        "errors": sum(report.get("errorDistribution", {}).values()),
        # What the errors were, by message, and every status ghz saw: a count alone does not
        # say whether the mesh refused a call or ghz cut one off at the end of its window.
        "error_messages": report.get("errorDistribution", {}),
        "status_codes": report.get("statusCodeDistribution", {}),
    }


def median_round(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round whose p50 is the median (the lower middle one of an even count), with every
    round's p50 and the errors of all rounds."""
    if not rounds:
        raise ValueError("no rounds")
    ordered = sorted(rounds, key=lambda r: r["p50_ms"])
    middle = ordered[(len(ordered) - 1) // 2]
    return {
        **middle,
        "errors": sum(r["errors"] for r in rounds),
        "rounds_p50_ms": [r["p50_ms"] for r in rounds],
    }


def ghz_beside_bench(
    binary: Path,
    gateway: str,
    texts: Sequence[str],
    cache: str,
    seconds: float,
    rounds: int,
    bench_window: Callable[[float], dict[str, Any]],
) -> dict[str, Any]:
    """ghz and `bench_window(seconds)` (one `hopline bench` window's figures for the same
    gateway, mix and cache mode) in `rounds` alternated turns of `seconds / rounds` each."""
    warm(binary, gateway, texts)
    window = seconds / rounds
    ghz_rounds: list[dict[str, Any]] = []
    bench_rounds: list[dict[str, Any]] = []
    for i in range(rounds):
        if i % 2:  # the order swaps every round: neither side always goes first
            bench_rounds.append(bench_window(window))
        ghz_rounds.append(ghz(binary, gateway, texts, cache, window))
        if not i % 2:
            bench_rounds.append(bench_window(window))
    return {"ghz": median_round(ghz_rounds), "hopline_bench": median_round(bench_rounds)}
