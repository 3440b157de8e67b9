"""Latency and failure behaviour of pymilvus + embedded milvus-lite for the semantic cache store.

The cache store talks to Milvus through `pymilvus.MilvusClient(uri)`; a uri ending in `.db` runs
milvus-lite embedded. milvus-lite 2.5.x starts a C++ `milvus` server as a subprocess and keeps
the data in one SQLite-style file; milvus-lite 3.x is a pure-Python engine (pyarrow + faiss)
served by an in-process gRPC server, and its `.db` path is a directory. Their latency and their
failure modes differ, and both drive the store's design (timeouts, error handling, start-up
validation), so this script measures, on one collection shaped like the cache's:

  1. insert: N rows (384-d float32, L2-normalised, seeded) in batches, per-batch latency;
  2. search: single-vector searches (limit 1 and 4) with the store's scalar filter
     (tenant, model, model_version, params, expires_at > now) on flushed ("sealed") data;
  3. mixed: insert one row then search for it, repeated, so recent rows sit in a growing
     segment; also whether the row just written is found (read-your-writes);
  4. get by primary key;
  5. delete by ids and by filter (the TTL purge `expires_at < t`);
plus `count(*)` with a filter, `query_iterator` over the whole collection, which vector index
types the engine accepts (FLAT, IVF_FLAT, HNSW, AUTOINDEX, with recall@4 against exact search),
what `describe_collection` / `describe_index` expose, and, with --probes, the failure modes:
the same db opened by two processes, corrupted db files, unreachable server uris, and what is
left behind (processes, files, data) when the owning process is killed, and what a call does
when the embedded server subprocess (2.5 only) stalls or dies under an open client.

Run it with the Python of a venv holding the pymilvus / milvus-lite pair under test, e.g.
  /tmp/mv25/bin/python bench/scripts/milvus_lite_versions.py --n 20000 --probes --json mv25.json
Latencies are wall-clock per client call, in milliseconds, one call at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

DIM = 384
COLLECTION = "semantic_cache"
T0 = 1_700_000_000.0  # created_at of row 0; row i is created at T0 + i seconds
INDEX_TYPES = ("FLAT", "IVF_FLAT", "HNSW", "AUTOINDEX")
BUILD_PARAMS: dict[str, dict[str, Any]] = {
    "FLAT": {},
    "IVF_FLAT": {"nlist": 128},
    "HNSW": {"M": 16, "efConstruction": 200},
    "AUTOINDEX": {},
}
SEARCH_PARAMS: dict[str, dict[str, Any]] = {
    "FLAT": {},
    "IVF_FLAT": {"nprobe": 16},
    "HNSW": {"ef": 64},
    "AUTOINDEX": {},
}
ITER_FIELDS = ["id", "created_at", "expires_at", "tenant", "model", "model_version"]
FILLER = (
    "Thank you for contacting support. Your order has been located and the refund was issued "
    "to the original payment method; it should appear within five business days. If you have "
    "further questions about invoices, returns, shipping or your account, reply to this message "
    "and an agent will follow up. Reference numbers are listed below for your records. "
)

Row = dict[str, Any]
Popen = subprocess.Popen[str]
Result = dict[str, Any]


# -- helpers ---------------------------------------------------------------------------------


def stats(ms: list[float]) -> Result:
    if not ms:
        return {"n": 0}
    a = np.asarray(ms)
    return {
        "n": len(a),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "max_ms": float(a.max()),
    }


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(milliseconds, result) of one call."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return (time.perf_counter() - start) * 1000.0, out


def describe_exc(exc: BaseException) -> Result:
    cls = type(exc)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "message": str(exc)[:600]}


def versions() -> Result:
    out: Result = {"python": platform.python_version(), "machine": platform.machine()}
    for dist in ("pymilvus", "milvus-lite", "numpy", "grpcio", "protobuf", "setuptools"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def unit(rng: np.random.Generator, count: int) -> np.ndarray:
    v = rng.standard_normal((count, DIM)).astype(np.float32)
    out: np.ndarray = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    return out


def near(rng: np.random.Generator, v: np.ndarray, noise: float = 0.02) -> np.ndarray:
    q = v + rng.standard_normal(v.shape).astype(np.float32) * noise
    out: np.ndarray = (q / np.linalg.norm(q, axis=-1, keepdims=True)).astype(np.float32)
    return out


def make_rows(rng: np.random.Generator, vectors: np.ndarray, start: int, n_total: int) -> list[Row]:
    """Rows `start .. start+len(vectors)`: 10 tenants, mostly model m / version 1 / no params,
    TTLs spread so that about half the rows are expired at `now(n_total)`."""
    rows: list[Row] = []
    for k, vec in enumerate(vectors):
        i = start + k
        created = T0 + i
        rows.append(
            {
                "id": f"k{i:08d}",
                "vector": vec.tolist(),
                "tenant": f"t{i % 10}",
                "model": "m" if rng.random() < 0.9 else "m2",
                "model_version": "1" if rng.random() < 0.8 else "2",
                "params": "" if rng.random() < 0.9 else '{"temperature": 0.7}',
                "text": f"question {i}: where is my order and when will the refund arrive?",
                "response": f"[{i}] " + FILLER[: int(rng.integers(200, len(FILLER)))],
                "created_at": created,
                "expires_at": created + float(rng.uniform(0, 2 * n_total)),
            }
        )
    return rows


def now_for(n_total: int) -> float:
    return T0 + n_total


def cache_filter(now: float, tenant: str = "t3") -> str:
    return (
        f'tenant == "{tenant}" and model == "m" and model_version == "1" and params == "" '
        f"and expires_at > {now}"
    )


def matches(row: Row, now: float) -> bool:
    return bool(
        row["tenant"] == "t3"
        and row["model"] == "m"
        and row["model_version"] == "1"
        and row["params"] == ""
        and row["expires_at"] > now
    )


# -- collection ------------------------------------------------------------------------------


def create_collection(client: Any, name: str, index_type: str) -> None:
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
    schema.add_field("tenant", DataType.VARCHAR, max_length=128)
    schema.add_field("model", DataType.VARCHAR, max_length=128)
    schema.add_field("model_version", DataType.VARCHAR, max_length=64)
    schema.add_field("params", DataType.VARCHAR, max_length=2048)
    schema.add_field("text", DataType.VARCHAR, max_length=8192)
    schema.add_field("response", DataType.VARCHAR, max_length=16384)
    schema.add_field("created_at", DataType.DOUBLE)
    schema.add_field("expires_at", DataType.DOUBLE)
    index = client.prepare_index_params()
    index.add_index(
        field_name="vector",
        index_type=index_type,
        metric_type="COSINE",
        params=BUILD_PARAMS[index_type],
    )
    if client.has_collection(name):
        client.drop_collection(name)
    client.create_collection(name, schema=schema, index_params=index)


def search_params(index_type: str) -> dict[str, Any]:
    return {"metric_type": "COSINE", "params": SEARCH_PARAMS[index_type]}


# -- the benchmark ---------------------------------------------------------------------------


def bench(client: Any, args: argparse.Namespace) -> Result:
    rng = np.random.default_rng(args.seed)
    n = args.n
    now = now_for(n)
    flt = cache_filter(now)
    sp = search_params(args.index)
    out: Result = {}

    ms, _ = timed(create_collection, client, COLLECTION, args.index)
    out["create_collection_ms"] = ms

    # 1. insert
    vectors = unit(rng, n)
    rows: list[Row] = []
    batch_ms: list[float] = []
    for start in range(0, n, args.batch):
        batch = make_rows(rng, vectors[start : start + args.batch], start, n)
        rows.extend(batch)
        ms, _ = timed(client.insert, COLLECTION, batch)
        batch_ms.append(ms)
    insert = stats(batch_ms)
    insert["batch_rows"] = args.batch
    insert["rows_per_s"] = n / (sum(batch_ms) / 1000.0)
    out["insert_batch"] = insert
    try:
        ms, _ = timed(client.flush, COLLECTION)
        out["flush_ms"] = ms
    except Exception as exc:
        out["flush_ms"] = None
        out["flush_error"] = describe_exc(exc)

    # 2. filtered search on sealed data: near-duplicates of rows that pass the filter, so the
    # expected top-1 is the source row (self-hit rate doubles as a recall check).
    eligible = [i for i, r in enumerate(rows) if matches(r, now)]
    out["filter_selectivity"] = len(eligible) / n
    src = rng.choice(eligible, size=args.queries)
    queries = near(rng, vectors[src])
    warm = near(rng, vectors[:20])
    for q in warm:
        client.search(COLLECTION, [q.tolist()], limit=1, filter=flt, search_params=sp)
    fields = ["response", "created_at", "expires_at"]
    for limit in (1, 4):
        lat: list[float] = []
        hits = 0
        for j, q in enumerate(queries):
            ms, res = timed(
                client.search,
                COLLECTION,
                [q.tolist()],
                limit=limit,
                filter=flt,
                output_fields=fields,
                search_params=sp,
            )
            lat.append(ms)
            hits += bool(res[0]) and res[0][0]["id"] == rows[src[j]]["id"]
        s = stats(lat)
        s["self_hit_rate"] = hits / len(queries)
        out[f"search_sealed_limit{limit}"] = s
    lat = []
    for q in queries[: min(200, len(queries))]:
        ms, _ = timed(client.search, COLLECTION, [q.tolist()], limit=1, search_params=sp)
        lat.append(ms)
    out["search_sealed_nofilter_limit1"] = stats(lat)

    # 3. mixed: insert one matching row, then search for it (growing segment).
    mixed_vectors = unit(rng, args.mixed)
    ins_ms: list[float] = []
    srch_ms: list[float] = []
    visible = 0
    for k, vec in enumerate(mixed_vectors):
        row = make_rows(rng, vec[None, :], n + k, n)[0]
        row.update(tenant="t3", model="m", model_version="1", params="", expires_at=now + 3600)
        ms, _ = timed(client.insert, COLLECTION, [row])
        ins_ms.append(ms)
        q = near(rng, vec)
        ms, res = timed(
            client.search,
            COLLECTION,
            [q.tolist()],
            limit=4,
            filter=flt,
            output_fields=fields,
            search_params=sp,
        )
        srch_ms.append(ms)
        visible += bool(res[0]) and res[0][0]["id"] == row["id"]
    out["mixed_insert_1"] = stats(ins_ms)
    mixed = stats(srch_ms)
    mixed["read_your_write_rate"] = visible / max(1, args.mixed)
    out["mixed_search_limit4"] = mixed
    total = n + args.mixed
    expected_live = sum(r["expires_at"] > now for r in rows) + args.mixed

    # 4. get by primary key (plus a miss)
    lat = []
    found = 0
    for i in rng.choice(n, size=args.queries):
        ms, res = timed(client.get, COLLECTION, ids=[rows[i]["id"]], output_fields=fields)
        lat.append(ms)
        found += len(res) == 1
    g = stats(lat)
    g["found_rate"] = found / args.queries
    out["get_by_id"] = g
    ms, res = timed(client.get, COLLECTION, ids=["no-such-id"])
    out["get_missing_id"] = {"ms": ms, "rows": len(res)}

    # count(*) with a filter, and query_iterator over everything
    ms, res = timed(
        client.query, COLLECTION, filter=f"expires_at > {now}", output_fields=["count(*)"]
    )
    out["count_filtered"] = {"ms": ms, "got": res[0]["count(*)"], "expected": expected_live}
    ms, res = timed(client.query, COLLECTION, filter="", output_fields=["count(*)"])
    out["count_all"] = {"ms": ms, "got": res[0]["count(*)"], "expected": total}
    out["query_iterator"] = read_all(client, total)

    # 5. delete: single ids, batches of ids, and the TTL purge by filter
    ids_t0 = [r["id"] for r in rows if r["tenant"] == "t0"]
    lat = []
    for i in range(args.deletes):
        ms, _ = timed(client.delete, COLLECTION, ids=[ids_t0[i]])
        lat.append(ms)
    out["delete_1_id"] = stats(lat)
    deleted_ids = set(ids_t0[: args.deletes])
    lat = []
    pos = args.deletes
    for _ in range(10):
        chunk = ids_t0[pos : pos + 100]
        pos += 100
        if not chunk:  # delete(ids=[]) raises DataTypeNotMatchException (pymilvus 3.0)
            break
        deleted_ids.update(chunk)
        ms, _ = timed(client.delete, COLLECTION, ids=chunk)
        lat.append(ms)
    out["delete_100_ids"] = stats(lat)
    lat = []
    counts: list[Any] = []
    for step in range(1, 21):
        cutoff = T0 + n * step / 20
        ms, res = timed(client.delete, COLLECTION, filter=f"expires_at < {cutoff}")
        lat.append(ms)
        # a server returns {"delete_count": n}; milvus-lite 3 returns the deleted primary keys
        counts.append(len(res) if isinstance(res, list) else res.get("delete_count"))
    purge = stats(lat)
    purge["delete_counts"] = counts
    purge["result_type"] = type(res).__name__
    out["delete_filter_expires"] = purge
    cutoff = T0 + n
    survivors = [r for r in rows if r["expires_at"] >= cutoff and r["id"] not in deleted_ids]
    ms, res = timed(client.query, COLLECTION, filter="", output_fields=["count(*)"])
    out["count_after_delete"] = {
        "ms": ms,
        "got": res[0]["count(*)"],
        "expected": len(survivors) + args.mixed,
    }
    ms, res = timed(client.get, COLLECTION, ids=[ids_t0[0]])
    out["get_deleted_id_rows"] = len(res)
    return out


def read_all(client: Any, expected: int) -> Result:
    try:
        start = time.perf_counter()
        it = client.query_iterator(
            COLLECTION, batch_size=1000, filter="", output_fields=ITER_FIELDS
        )
        seen: set[str] = set()
        keys: list[str] = []
        while True:
            page = it.next()
            if not page:
                break
            if not keys:
                keys = sorted(page[0].keys())
            seen.update(r["id"] for r in page)
        it.close()
        return {
            "ok": True,
            "ms": (time.perf_counter() - start) * 1000.0,
            "rows": len(seen),
            "expected": expected,
            "row_keys": keys,
        }
    except Exception as exc:
        return {"ok": False, "error": describe_exc(exc)}


# -- index types -----------------------------------------------------------------------------


def probe_indexes(client: Any, n: int, seed: int) -> Result:
    rng = np.random.default_rng(seed + 1)
    vectors = unit(rng, n)
    rows = make_rows(rng, vectors, 0, n)
    queries = near(rng, vectors[rng.choice(n, size=100)], noise=0.08)
    truth = np.argsort(-(queries @ vectors.T), axis=1)[:, :4]
    out: Result = {}
    for index_type in INDEX_TYPES:
        name = f"probe_{index_type.lower()}"
        res: Result = {}
        stage = "create"
        try:
            create_collection(client, name, index_type)
            stage = "insert"
            for start in range(0, n, 1000):
                client.insert(name, rows[start : start + 1000])
            stage = "flush"
            client.flush(name)
            stage = "describe_index"
            desc = client.describe_index(name, "vector")
            res["described_index_type"] = desc.get("index_type")
            res["described_params"] = {
                k: v for k, v in desc.items() if k not in ("field_name", "index_name")
            }
            stage = "search"
            lat: list[float] = []
            recall = 0
            sp = search_params(index_type)
            for q, want in zip(queries, truth, strict=True):
                ms, hits = timed(client.search, name, [q.tolist()], limit=4, search_params=sp)
                lat.append(ms)
                got = {h["id"] for h in hits[0]}
                recall += len(got & {rows[i]["id"] for i in want})
            res.update(ok=True, recall_at_4=recall / (4 * len(queries)), search=stats(lat))
        except Exception as exc:
            res.update(ok=False, stage=stage, error=describe_exc(exc))
        with contextlib.suppress(Exception):
            client.drop_collection(name)
        out[index_type] = res
    return out


def schema_introspection(client: Any) -> Result:
    desc = client.describe_collection(COLLECTION)
    vec = next(f for f in desc["fields"] if f["name"] == "vector")
    idx = client.describe_index(COLLECTION, "vector")
    load: Any
    try:
        load = client.get_load_state(COLLECTION)
    except Exception as exc:
        load = describe_exc(exc)
    return {
        "describe_collection_keys": sorted(desc.keys()),
        "field_keys": sorted(vec.keys()),
        "vector_field": {k: str(v) for k, v in vec.items()},
        "describe_index": {k: str(v) for k, v in idx.items()},
        "list_indexes": client.list_indexes(COLLECTION),
        "load_state": str(load),
    }


# -- failure-mode probes (each runs in a child process of this script) -------------------------


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


# -- output ----------------------------------------------------------------------------------


def table(res: Result) -> str:
    lines = [f"{'measurement':<32} {'n':>6} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}  note"]
    notes = {
        "insert_batch": lambda r: f"{r['batch_rows']} rows/batch, {r['rows_per_s']:.0f} rows/s",
        "search_sealed_limit1": lambda r: f"self-hit {r['self_hit_rate']:.3f}",
        "search_sealed_limit4": lambda r: f"self-hit {r['self_hit_rate']:.3f}",
        "mixed_search_limit4": lambda r: f"read-your-write {r['read_your_write_rate']:.3f}",
        "get_by_id": lambda r: f"found {r['found_rate']:.3f}",
        "delete_filter_expires": lambda r: (
            f"{len(r['delete_counts'])} sweeps, {sum(c or 0 for c in r['delete_counts'])} rows, "
            f"returns {r['result_type']}"
        ),
    }
    for key, val in res.items():
        if isinstance(val, dict) and "p50_ms" in val:
            note = notes[key](val) if key in notes else ""
            lines.append(
                f"{key:<32} {val['n']:>6} {val['p50_ms']:>9.2f} {val['p99_ms']:>9.2f} "
                f"{val['mean_ms']:>9.2f}  {note}"
            )
    for key in ("create_collection_ms", "flush_ms"):
        if isinstance(res.get(key), float):
            lines.append(f"{key:<32} {1:>6} {res[key]:>9.2f}")
    for key in ("count_filtered", "count_all", "count_after_delete", "get_missing_id"):
        if key in res:
            lines.append(f"{key:<32} {json.dumps(res[key])}")
    return "\n".join(lines)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000, help="rows inserted (default 20000)")
    parser.add_argument("--batch", type=int, default=500, help="rows per insert call")
    parser.add_argument("--queries", type=int, default=500, help="searches / gets per phase")
    parser.add_argument("--mixed", type=int, default=500, help="insert+search iterations")
    parser.add_argument("--deletes", type=int, default=200, help="single-id deletes")
    parser.add_argument(
        "--index", default="FLAT", choices=INDEX_TYPES, help="index of the main collection"
    )
    parser.add_argument("--probe-n", type=int, default=5000, help="rows per index-type probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir)")
    parser.add_argument("--probes", action="store_true", help="also run failure-mode probes")
    parser.add_argument("--quiet", action="store_true", help="set the pymilvus logger to CRITICAL")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--child", choices=("open", "populate", "faults"), help=argparse.SUPPRESS)
    parser.add_argument("--child-uri", help=argparse.SUPPRESS)
    parser.add_argument("--child-hold", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--child-timeout", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-kill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return

    workdir = Path(args.dir or tempfile.mkdtemp(prefix="milvus-lite-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: Result = {"versions": versions(), "config": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(report["versions"]))
    with warnings.catch_warnings(record=True) as caught:
        if not sys.warnoptions:  # honour `python -W error ...`
            warnings.simplefilter("always")
        if args.quiet:
            logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
        from pymilvus import MilvusClient

        uri = str(workdir / "bench.db")
        ms, client = timed(MilvusClient, uri)
        report["open_ms"] = ms
        started = time.perf_counter()
        report["results"] = bench(client, args)
        report["bench_s"] = time.perf_counter() - started
        report["introspection"] = schema_introspection(client)
        report["index_types"] = probe_indexes(client, args.probe_n, args.seed)
        client.close()
        # close() leaves the embedded server running (2.5: a subprocess, 3.x: threads) until
        # interpreter exit; release it so the db is closed before the work dir is removed.
        from milvus_lite.server_manager import server_manager_instance

        report["release_ms"], _ = timed(server_manager_instance.release_server, uri)
    report["warnings"] = sorted(
        {f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught}
    )
    if args.probes:
        probe_dir = workdir / "probes"
        probe_dir.mkdir(exist_ok=True)
        report["probes"] = probes(probe_dir)

    print(f"open MilvusClient: {report['open_ms']:.1f} ms; benchmark {report['bench_s']:.1f} s")
    print(table(report["results"]))
    print("index types:")
    for name, r in report["index_types"].items():
        if r.get("ok"):
            print(
                f"  {name:<10} ok  described={r['described_index_type']}  "
                f"recall@4={r['recall_at_4']:.3f}  search p50={r['search']['p50_ms']:.2f} ms"
            )
        else:
            print(f"  {name:<10} FAIL at {r['stage']}: {r['error']}")
    print("warnings:", *report["warnings"] or ["none"], sep="\n  ")
    for name, r in report.get("probes", {}).items():
        print(f"probe {name}: {probe_line(r)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
