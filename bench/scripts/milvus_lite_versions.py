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
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from milvus_lite_data import (
    COLLECTION,
    INDEX_TYPES,
    ITER_FIELDS,
    T0,
    Result,
    Row,
    cache_filter,
    create_collection,
    describe_exc,
    make_rows,
    matches,
    near,
    now_for,
    search_params,
    stats,
    timed,
    unit,
    versions,
)
from milvus_lite_probes import probe_line, probes

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
    args = parser.parse_args()

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
