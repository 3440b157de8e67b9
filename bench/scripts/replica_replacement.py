"""Replace one of two inference replicas again and again under closed-loop load, and count the
requests that fail: what a rollout costs callers.

One mesh (five processes) plus a second inference process; the gateway dials inference as
`ipv4:A,B`. Four threads send Predicts with new texts (each reaches inference) while the
replicas are replaced in turn, as tests/mesh/test_rolling_replacement.py does: SIGTERM (it
drains), a new process on the same port, then wait until it has answered 20 calls and the
manifests' minReadySeconds have passed. The gateway's `hop failed` log lines are summarised.

Usage: .venv/bin/python bench/scripts/replica_replacement.py [--replacements 12]
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.launcher import Mesh

ROOT = Path(__file__).resolve().parents[2]
MODEL = "support-intents"
WORKERS = 4
TEXTS = ["where is my order", "I forgot my password", "cancel my subscription", "talk to a human"]


def served_ok(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hopline_rpc_duration_seconds_count{") and 'code="OK"' in line
    )


def min_ready_s() -> float:
    text = (ROOT / "deploy" / "k8s" / "base" / "inference.yaml").read_text()
    found = re.search(r"^\s*minReadySeconds:\s*(\d+)", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repo", type=Path, default=ROOT / "models")
    parser.add_argument("--replacements", type=int, default=12)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hopline-replica-replacement-"))
    repo = work / "models"
    shutil.copytree(args.model_repo / MODEL, repo / MODEL)
    lean = {"HOPLINE_INFERENCE_THREADS": "1", "HOPLINE_CACHE_EMBED_THREADS": "1"}
    meshes = []
    for name in ("a", "b"):
        (work / name).mkdir()
        meshes.append(Mesh.on_free_ports(repo, work / name, env=lean))
    a, b = meshes
    a.service_env["gateway"] = {
        "HOPLINE_INFERENCE_ADDR": f"ipv4:{a.addrs['inference']},{b.addrs['inference']}"
    }
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stopping = threading.Event()

    def load(worker: int) -> None:
        with grpc.insecure_channel(a.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            i = worker
            while not stopping.is_set():
                text = f"{TEXTS[i % len(TEXTS)]} (request {i})"
                i += WORKERS
                try:
                    stub.Predict(gateway_pb2.PredictRequest(text=text), timeout=10)
                    outcome = "OK"
                except grpc.RpcError as err:
                    outcome = f"{err.code().name}: {err.details()}"
                with lock:
                    outcomes[outcome] += 1

    try:
        b.start(names=["inference"])
        a.start()
        threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(WORKERS)]
        for thread in threads:
            thread.start()
        time.sleep(3)
        for n in range(args.replacements):
            mesh = (b, a)[n % 2]
            assert mesh.terminate("inference") == 0, "inference did not drain cleanly"
            mesh.spawn(["inference"])
            mesh.wait_serving("inference")
            since = time.monotonic()
            while served_ok(mesh.metrics_ports["inference"]) < 20:
                time.sleep(0.05)
            time.sleep(max(0.0, since + min_ready_s() - time.monotonic()))
            with lock:
                print(f"replacement {n + 1}: {dict(outcomes)}", flush=True)
    finally:
        stopping.set()
        time.sleep(1)
        a.stop()
        b.stop()
    failures = Counter(
        re.sub(r"\b\d+(\.\d+){3}:\d+\b", "<address>", line.split(" hop failed ", 1)[1]).split(
            " trace_id="
        )[0]
        for line in a.log("gateway").splitlines()
        if " hop failed " in line
    )
    total = sum(outcomes.values())
    print(f"requests: {total}, failed: {total - outcomes['OK']}: {dict(outcomes)}")
    for line, count in failures.most_common(5):
        print(f"{count:6d} x {line}")


if __name__ == "__main__":
    main()
