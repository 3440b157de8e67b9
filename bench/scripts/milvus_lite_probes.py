"""Failure-mode probes of pymilvus + embedded milvus-lite, for bench/scripts/milvus_lite_versions.py
(`--probes`): the same db opened by two processes, corrupted db files, unreachable server uris,
what is left behind when the owning process is killed, and what a call does when the embedded
server subprocess (2.5 only) stalls or dies under an open client.

Each probe runs in a child process: this file with `--child MODE --child-uri URI`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from milvus_lite_data import (
    COLLECTION,
    DIM,
    Popen,
    Result,
    create_collection,
    describe_exc,
    make_rows,
    unit,
)


def child_main(args: argparse.Namespace) -> None:
    """`--child open URI`: open, touch every collection, print one JSON line, hold, exit.
    `--child populate URI`: create + insert 2000 rows (+ flush unless --child-kill), then
    exit, or SIGKILL itself right after the last insert is acknowledged.
    `--child faults URI`: stall, then kill, the embedded server subprocess (see server_faults)."""
    warnings.simplefilter("ignore")
    from pymilvus import MilvusClient

    res: Result = {"pid": os.getpid()}
    start = time.perf_counter()
    try:
        kwargs = {} if args.child_timeout is None else {"timeout": args.child_timeout}
        client = MilvusClient(args.child_uri, **kwargs)
        res["open_s"] = time.perf_counter() - start
        if args.child == "faults":
            res.update(server_faults(client))
        elif args.child == "populate":
            rng = np.random.default_rng(0)
            create_collection(client, COLLECTION, "FLAT")
            vecs = unit(rng, 2000)
            for s in range(0, 2000, 500):
                client.insert(COLLECTION, make_rows(rng, vecs[s : s + 500], s, 2000))
            if args.child_kill:
                print(json.dumps(res), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            client.flush(COLLECTION)
        else:
            res["collections"] = client.list_collections()
            counts = {}
            for name in res["collections"]:
                client.load_collection(name)
                counts[name] = client.query(name, filter="", output_fields=["count(*)"])[0][
                    "count(*)"
                ]
                client.search(name, [np.ones(DIM).tolist()], limit=1)
            res["counts"] = counts
        res["ok"] = True
    except Exception as exc:
        res.update(ok=False, after_s=time.perf_counter() - start, error=describe_exc(exc))
    print(json.dumps(res, default=str), flush=True)
    time.sleep(args.child_hold)


def search_outcome(client: Any, timeout: float | None) -> Result:
    start = time.perf_counter()
    try:
        client.search(COLLECTION, [np.ones(DIM).tolist()], limit=1, timeout=timeout)
        res: Result = {"ok": True}
    except Exception as exc:
        res = {"ok": False, "error": describe_exc(exc)}
        if hasattr(exc, "code") and callable(exc.code):  # grpc.RpcError
            res["grpc_code"] = str(exc.code())
    res["after_s"] = time.perf_counter() - start
    return res


def server_faults(client: Any) -> Result:
    """milvus-lite 2.5 only (3.x has no server process): SIGSTOP the server and search with
    and without a per-call timeout, then SIGKILL it and search again."""
    create_collection(client, COLLECTION, "FLAT")
    kids = descendants(os.getpid())
    if not kids:
        return {"skipped": "no server subprocess (milvus-lite 3.x runs in-process)"}
    res: Result = {}
    for k in kids:
        os.kill(k, signal.SIGSTOP)
    res["stalled_timeout_1s"] = search_outcome(client, 1.0)
    box: list[Result] = []
    worker = threading.Thread(target=lambda: box.append(search_outcome(client, None)), daemon=True)
    worker.start()
    worker.join(5.0)
    res["stalled_no_timeout_blocked_5s"] = worker.is_alive()
    for k in kids:
        os.kill(k, signal.SIGCONT)
    worker.join(10.0)
    res["stalled_no_timeout_after_resume"] = box[0] if box else None
    for k in kids:
        os.kill(k, signal.SIGKILL)
    time.sleep(0.5)
    res["dead_timeout_2s"] = search_outcome(client, 2.0)
    return res


def spawn(mode: str, uri: str, *, hold: float = 0.0, timeout: float | None = None) -> Popen:
    """This script in `--child` mode, in its own session (so a kill reaches its children)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode.split("-")[0]]
    cmd += ["--child-uri", uri, "--child-hold", str(hold)]
    if timeout is not None:
        cmd += ["--child-timeout", str(timeout)]
    if mode == "populate-kill":
        cmd.append("--child-kill")
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        # a holding child is read line by line; its logs must not fill a pipe nobody drains
        stderr=subprocess.DEVNULL if hold else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_child(mode: str, uri: str, timeout: float | None = None, limit_s: float = 90) -> Result:
    """Run a child to completion; its JSON line, exit code and stderr tail, or `hang`."""
    p = spawn(mode, uri, timeout=timeout)
    start = time.perf_counter()
    try:
        stdout, stderr = p.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return {"ok": False, "hang": True, "waited_s": limit_s}
    res: Result = {}
    lines = stdout.strip().splitlines()
    with contextlib.suppress(json.JSONDecodeError, IndexError):
        res = json.loads(lines[-1])
    res["wall_s"] = time.perf_counter() - start
    res["rc"] = p.returncode
    res["stderr_tail"] = [line[:300] for line in stderr.strip().splitlines()[-4:]]
    return res


def first_line(p: Popen) -> Result:
    assert p.stdout is not None
    res: Result = json.loads(p.stdout.readline())
    return res


def descendants(pid: int) -> list[int]:
    kids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids += [int(entry.name), *descendants(int(entry.name))]
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def stale_sockets(db: Path) -> list[str]:
    """milvus-lite 2.5 serves on a unix socket `<tmpdir>/tmpXXXX_<db name>.sock`."""
    return sorted(str(p) for p in Path(tempfile.gettempdir()).glob(f"tmp*_{db.name}.sock"))


def kill_owner(workdir: Path, name: str, sig: signal.Signals, *, group: bool) -> Result:
    db = workdir / name
    holder = spawn("open", str(db), hold=120)
    first_line(holder)
    kids = descendants(holder.pid)
    before = listing(workdir)
    sockets = stale_sockets(db)
    if group:
        os.killpg(holder.pid, sig)
    else:
        os.kill(holder.pid, sig)
    holder.communicate()
    res: Result = {"signal": sig.name, "process_group": group, "children": kids}
    for wait in (0.2, 1.0, 5.0):
        time.sleep(wait)
        res[f"alive_after_{wait}s"] = [k for k in kids if alive(k)]
    res.update(
        files_before=before,
        files_after=listing(workdir),
        sockets_before=sockets,
        sockets_after=stale_sockets(db),
        reopen=run_child("open", str(db)),
    )
    for k in kids:  # never leave anything of ours behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(k, signal.SIGKILL)
    for sock in res["sockets_after"]:
        Path(sock).unlink(missing_ok=True)
    return res


def probes(workdir: Path) -> Result:
    out: Result = {}

    # a. two processes, one db
    db = workdir / "two.db"
    holder = spawn("open", str(db), hold=60)
    first = first_line(holder)
    second = run_child("open", str(db))
    os.kill(holder.pid, signal.SIGTERM)
    holder.communicate()
    out["a_two_processes"] = {"first": first, "second": second}

    # b. corrupted db files
    bad = workdir / "random.db"
    bad.write_bytes(np.random.default_rng(1).bytes(65536))
    out["b_random_bytes_file"] = run_child("open", str(bad))
    empty = workdir / "empty.db"
    empty.touch()
    out["b_empty_file"] = run_child("open", str(empty))
    real = workdir / "real.db"
    out["b_populate"] = run_child("populate", str(real))
    victim = real
    if real.is_dir():  # milvus-lite 3.x: truncate the largest file (a parquet data file)
        victim = max((p for p in real.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = victim.stat().st_size
    with victim.open("r+b") as fh:
        fh.truncate(size // 2)
    out["b_truncated"] = {
        "file": str(victim.relative_to(workdir)),
        "bytes": [size, size // 2],
        **run_child("open", str(real)),
    }

    # c. server uris that do not answer
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # accepts TCP (kernel backlog) and never speaks HTTP/2
    hung_uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
    for label, uri in (
        ("refused", "http://127.0.0.1:1"),
        ("listening_silent", hung_uri),
        ("blackhole_10.255.255.1", "http://10.255.255.1:19530"),
    ):
        for timeout in (2.0, None):
            out[f"c_{label}_timeout_{timeout}"] = run_child("open", uri, timeout=timeout)
    hung.close()

    # h. the owning process killed: SIGKILL to it alone, SIGTERM to its whole process group
    # (what a terminal, `docker stop` or systemd do): children, files left behind, reopening
    out["h_sigkill"] = kill_owner(workdir, "kill.db", signal.SIGKILL, group=False)
    out["h_sigterm_group"] = kill_owner(workdir, "group.db", signal.SIGTERM, group=True)

    # i. the embedded server stalls / dies under an open client (pymilvus 2.5 retries for
    # minutes on a dead server whatever the timeout, hence the long limit)
    out["i_server_faults"] = run_child("faults", str(workdir / "faults.db"), limit_s=400)
    dur = workdir / "durable.db"
    spawn_res = run_child("populate-kill", str(dur))
    out["h_sigkill_after_insert"] = {"writer": spawn_res, "reopen": run_child("open", str(dur))}
    return out


def probe_line(r: Result) -> str:
    if "second" in r:  # two processes: what the second one got
        r = r["second"]
    if "reopen" in r and "writer" in r:
        return f"rows after reopen: {r['reopen'].get('counts')}"
    if "stalled_timeout_1s" in r:
        return (
            f"stalled+timeout: {r['stalled_timeout_1s']}; stalled, no timeout, blocked: "
            f"{r['stalled_no_timeout_blocked_5s']}; dead+timeout=2: {r['dead_timeout_2s']}"
        )
    if "skipped" in r:
        return str(r["skipped"])
    if "signal" in r:
        return (
            f"children {r['children']} alive after 0.2s: {r['alive_after_0.2s']}, "
            f"stale sockets: {len(r['sockets_after'])}, reopen ok: {r['reopen'].get('ok')}"
        )
    if r.get("hang"):
        return f"HANG (killed after {r['waited_s']} s)"
    if r.get("ok"):
        return f"ok in {r.get('open_s', 0):.2f} s, counts {r.get('counts')}"
    err = r.get("error", {})
    return f"{err.get('type')} after {r.get('after_s', 0):.3f} s: {err.get('message', '')[:150]}"


def main() -> None:
    """A probe's child process (`spawn`): see child_main."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", required=True, choices=("open", "populate", "faults"))
    parser.add_argument("--child-uri", required=True)
    parser.add_argument("--child-hold", type=float, default=0.0)
    parser.add_argument("--child-timeout", type=float, default=None)
    parser.add_argument("--child-kill", action="store_true")
    child_main(parser.parse_args())


if __name__ == "__main__":
    main()
