"""`hopline bench` against a live mesh: the JSON scripts compute ratios from."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from harness import TOPOLOGIES, Mesh, free_port
from hopline.bench.baselines import inprocess_target, start_echo, start_server, stop_server
from hopline.bench.targets import ECHO, PREDICT
from hopline.model.build import DEFAULT_MODEL_NAME
from hopline.protos.hopline.gateway.v1 import gateway_pb2


def test_bench_writes_every_target_with_the_documented_keys(mesh: Mesh, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "bench", "--target", mesh.gateway,
         "--concurrency", "2", "--duration", "1", "--warmup", "0.5", "--mix", "miss",
         "--baseline", "echo,echo_idle,inprocess,inprocess_batched", "--idle-ms", "5",
         "--model-repo", str(mesh.repo), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert set(doc["targets"]) == {"echo", "echo_idle", "inprocess", "inprocess_batched", "mesh"}
    for name, target in doc["targets"].items():
        for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "throughput_rps", "requests"):
            assert target[key] > 0, (name, key)
        assert target["errors"] == 0, (name, target["errors_by_status"])
        assert target["p50_ms"] <= target["p99_ms"] <= target["max_ms"]
    mesh_hops = doc["targets"]["mesh"]["hops_ms"]
    assert {"tokenize", "inference", "inference.compute", "postprocess"} <= set(mesh_hops)
    # The in-process pipelines time their model runs as the inference service does, so the
    # model's own run can be read against the mesh's (bench/suite_report.py:model_run_share).
    for name in ("inprocess", "inprocess_batched"):
        runs = doc["targets"][name]["hops_ms"]
        assert {"inference.queue", "inference.compute"} == set(runs), (name, runs)
        assert runs["inference.compute"]["count"] == doc["targets"][name]["requests"]
        assert 0 < runs["inference.compute"]["p50"] < doc["targets"][name]["p50_ms"]
    # Every text is new: each request misses (or fails open, on a machine too busy for the
    # lookup budget), and the outcomes account for every request.
    outcomes = doc["targets"]["mesh"]["cache_outcomes"]
    assert set(outcomes) <= {"miss", "fail_open"}, outcomes
    assert sum(outcomes.values()) == doc["targets"]["mesh"]["requests"]
    assert "mesh_p50_over_echo_p50" in doc["ratios"]
    assert "mesh_p50_minus_inprocess_in_echo_idle_p50s" in doc["ratios"]
    assert "mesh_p50_over_inprocess_batched_p50" in doc["ratios"]
    # Each of the 2 echo_idle callers waits 5 ms before each call: at most one call per 5 ms.
    idle = doc["targets"]["echo_idle"]
    assert idle["requests"] <= 2 * (idle["duration_s"] / 0.005 + 1), idle["requests"]
    assert idle["requests"] < doc["targets"]["echo"]["requests"]
    assert "mesh" in run.stdout  # the table


@pytest.mark.parametrize("mesh", TOPOLOGIES, indirect=True, ids=str)
def test_bench_splits_each_hop_between_the_gateway_and_the_server(
    mesh: Mesh, tmp_path: Path
) -> None:
    """`--metrics`: the mesh's own histograms, read around the window alone, give every hop
    a miss takes from both sides, in its own process or co-located in the gateway's; the
    server's time lies inside the gateway's."""
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "bench", "--target", mesh.gateway,
         "--concurrency", "1", "--duration", "1", "--warmup", "0.5", "--mix", "miss",
         "--baseline", "echo", "--metrics", f"mesh={','.join(mesh.metrics_endpoints())}",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    target = json.loads(out.read_text())["targets"]["mesh"]
    requests = target["requests"]
    assert requests > 0
    split = target["hop_split"]
    for hop in ("tokenize", "inference", "postprocess"):
        h = split["hops"][hop]
        # One call per request at concurrency 1, none of the warm-up's.
        assert h["calls"] == requests, (hop, h)
        assert h["server_calls"] == requests, (hop, h)
        assert 0 < h["server_ms"] < h["at_gateway_ms"], (hop, h)
    request = split["request"]
    assert request["gateway_calls"] == requests
    assert 0 < request["gateway_ms"] < request["client_ms"] == target["mean_ms"]
    assert "outside the gateway" in run.stdout
    assert "hop_split" not in json.loads(out.read_text())["targets"]["echo"]
    # Each process's CPU per request, named by the services it answers for: every service
    # in exactly one process, the gateway's first.
    cpu = split["cpu_ms_per_request"]
    assert len(cpu) == len(mesh.metrics_endpoints()), cpu
    services = [s for name in cpu for s in name.split("+")]
    assert sorted(services) == ["cache", "gateway", "inference", "postprocess", "tokenizer"]
    gateway_process = next(iter(cpu))
    assert gateway_process.startswith("gateway")
    # The kernel counts a process's CPU in 10 ms ticks: a quiet process (the cache, storing a
    # few batches in this 1 s window) may read 0; the gateway answered every request.
    assert cpu[gateway_process] > 0, cpu
    assert all(ms >= 0 for ms in cpu.values()), cpu
    assert target["cpu_ms_per_request"]["machine"] > target["cpu_ms_per_request"]["load_generator"]
    assert "CPU ms per request: gateway" in run.stdout


def test_the_exact_mix_repeats_only_texts_the_cache_keeps(mesh: Mesh, tmp_path: Path) -> None:
    """Some primed texts get out-of-scope answers, which the default model's policy does not
    cache: left in, they would be misses inside a window meant to hold only repeats."""
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "bench", "--target", mesh.gateway,
         "--concurrency", "1", "--duration", "1", "--warmup", "0.2", "--mix", "exact",
         "--baseline", "none", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "primed texts are not kept by the cache" in run.stderr  # 3 of 64, out of scope
    target = json.loads(out.read_text())["targets"]["mesh"]
    assert target["cache_outcomes"] == {"exact": target["requests"]}


@pytest.mark.parametrize(("env_loop", "runs"), [(None, "uvloop"), ("asyncio", "asyncio")])
def test_the_echo_baseline_runs_on_the_services_event_loop(
    env_loop: str | None, runs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The echo is the floor the mesh's targets are written in: on another loop than the
    services' (uvloop by default, HOPLINE_EVENT_LOOP) it would measure another transport."""
    if env_loop is None:
        monkeypatch.delenv("HOPLINE_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("HOPLINE_EVENT_LOOP", env_loop)
    proc, address, said = start_echo()
    try:
        assert said == runs
        with open(f"/proc/{proc.pid}/maps", encoding="utf-8") as maps:
            assert ("/uvloop/" in maps.read()) == (runs == "uvloop")
        with grpc.insecure_channel(address) as channel:
            assert channel.unary_unary(ECHO, None, None)(b"ping", timeout=10) == b"ping"
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # and closes the READY pipe


def test_the_front_door_baseline_answers_as_the_in_process_pipeline(default_repo: Path) -> None:
    """grpc_batched's server (bench/front_door.py) is the in-process batched pipeline behind
    gRPC: the same labels for the same texts, and an empty text refused as the gateway does."""
    proc, address, said = start_server(
        "hopline.bench.front_door", "--model-repo", str(default_repo)
    )
    texts = ["how do I reset my password", "I want a refund for my order", "hello there"]
    try:
        assert said in ("uvloop", "asyncio")
        with grpc.insecure_channel(address) as channel:
            predict = channel.unary_unary(
                PREDICT,
                gateway_pb2.PredictRequest.SerializeToString,
                gateway_pb2.PredictResponse.FromString,
            )
            served = [predict(gateway_pb2.PredictRequest(text=t), timeout=30) for t in texts]
            with pytest.raises(grpc.RpcError) as refused:
                predict(gateway_pb2.PredictRequest(text=""), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stop_server(proc)
    assert proc.returncode == 0  # drained on SIGTERM
    assert {r.model for r in served} == {DEFAULT_MODEL_NAME}
    expected = asyncio.run(_in_process_labels(default_repo, texts))
    assert [r.prediction.label for r in served] == expected
    assert all(0.0 < r.prediction.score <= 1.0 for r in served)


async def _in_process_labels(repo: Path, texts: list[str]) -> list[str]:
    settings = argparse.Namespace(model="", model_repo=repo, concurrency=1, rps=0)
    target = inprocess_target("inprocess_batched", settings)
    try:
        return [(await target.call(t)).prediction.label for t in texts]
    finally:
        await target.close()


def test_bench_measures_the_front_door_beside_the_mesh(mesh: Mesh, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "bench", "--target", mesh.gateway,
         "--concurrency", "4", "--duration", "1", "--warmup", "0.5", "--mix", "miss",
         "--baseline", "grpc_batched", "--model-repo", str(mesh.repo), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    door = doc["targets"]["grpc_batched"]
    assert door["requests"] > 0
    assert door["errors"] == 0
    assert doc["ratios"]["mesh_throughput_over_grpc_batched"] == pytest.approx(
        doc["targets"]["mesh"]["throughput_rps"] / door["throughput_rps"]
    )


def test_a_target_nothing_listens_on_is_said_before_any_window() -> None:
    """A gateway address nothing listens on: the bench says so and exits 2 before it runs
    any baseline (it ran them all, then printed NaN ratios for the mesh)."""
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "bench", "--target", f"127.0.0.1:{free_port()}",
         "--duration", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "no gateway answered at 127.0.0.1:" in run.stderr
    assert "measuring" not in run.stderr  # no window ran


def test_a_target_that_answers_nothing_reads_as_nothing(tmp_path: Path) -> None:
    """A server that answers (so the bench runs) but serves no gateway: every call fails
    within microseconds. The bench reports 0 requests, 0 rps and the failures as errors,
    and exits 1; before, refusals were timed as requests (about 18,000 rps at a p50 of 0.04
    ms)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = tmp_path / "bench.json"
    try:
        run = subprocess.run(
            [sys.executable, "-m", "hopline", "bench", "--target", f"127.0.0.1:{port}",
             "--baseline", "none", "--duration", "1", "--warmup", "0", "--json", str(out)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        server.stop(None)
    assert run.returncode == 1, run.stderr
    mesh = json.loads(out.read_text())["targets"]["mesh"]
    assert (mesh["requests"], mesh["throughput_rps"]) == (0, 0.0), mesh
    assert set(mesh["errors_by_status"]) == {"UNIMPLEMENTED"}, mesh["errors_by_status"]
    assert mesh["errors"] > 0


def test_a_bench_server_ends_with_the_bench_that_started_it() -> None:
    """A `hopline bench` stopped by SIGTERM (or killed) left its echo server listening,
    re-parented to init (an operator's probe: still there 26 s later). The server follows its
    bench (runtime/parent.py:follow_parent): here a stand-in bench, killed outright."""
    script = (
        "from hopline.bench.baselines import start_echo\n"
        "import time\n"
        "proc, _, _ = start_echo()\n"
        "print(proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    echo = int(bench.stdout.readline())
    bench.kill()
    bench.wait()
    bench.stdout.close()
    deadline = time.monotonic() + 20
    while _alive(echo):
        assert time.monotonic() < deadline, "the echo server outlived its bench"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, re-parented to init and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
