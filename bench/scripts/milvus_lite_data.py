"""The collection and the rows bench/scripts/milvus_lite_versions.py measures pymilvus and
milvus-lite with: a schema shaped like the cache's, seeded 384-d rows, the store's filter.
No hopline import: the scripts run with the Python of whichever venv holds the pymilvus /
milvus-lite pair under test.
"""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
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
