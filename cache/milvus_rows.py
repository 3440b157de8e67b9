"""A cache entry as a row of its Milvus collection, and back: the one place that knows the
collection's fields and how long Milvus lets each be.

Filters compare only hex digests and numbers: no tenant or model name is ever spliced into an
expression, and a key reaches one only as the SHA-256 hex digest `entry_id` lets through.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from hopline.cache.keys import digest, scope_digest
from hopline.cache.store import Entry, Scope, Vector

MAX_TEXT_BYTES = 65_535  # Milvus VARCHAR limit, in bytes
SCOPE_NAME_MAX = 256  # bytes of a tenant, model or version name the collection holds
DIGESTS = ("scope_key", "tenant_key", "model_key", "version_key")
SCALARS = (
    *DIGESTS,
    "tenant",
    "model",
    "model_version",
    "params",
    "text",
    "response",
    "created_at",
    "expires_at",
)


def entry_id(key: str) -> str:
    # Keys are our own SHA-256 digests; anything else must never reach a filter expression.
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"not a cache entry id: {key[:80]!r}")
    return key


def id_ranges() -> list[str]:
    """Filters that split the ids by their first hex digit into 16 ranges, each id in exactly
    one: the first range and the last are open-ended, so even an id no digest could be has
    one."""
    firsts = "123456789abcdef"
    ranges = [f'id < "{firsts[0]}"']
    ranges += [f'id >= "{low}" and id < "{high}"' for low, high in itertools.pairwise(firsts)]
    ranges.append(f'id >= "{firsts[-1]}"')
    return ranges


def deleted_count(result: Any) -> int:
    # pymilvus returns {"delete_count": n} from a server and a list of ids from milvus-lite.
    if isinstance(result, dict):
        return int(result.get("delete_count", 0))
    return len(result)


def row_problem(scope: Scope, text: str, response: bytes) -> str:
    """Why the collection cannot hold a row of these fields ('' when it can): Milvus refuses a
    VARCHAR over its field's length, and with it every row of the write that carried it."""
    for field, value in zip(("tenant", "model", "model_version"), scope[:3], strict=True):
        if len(value.encode("utf-8")) > SCOPE_NAME_MAX:
            return f"scope {field} is over {SCOPE_NAME_MAX} bytes"
    if len(scope[3].encode("utf-8")) > MAX_TEXT_BYTES:
        return f"scope parameters are over {MAX_TEXT_BYTES} bytes"
    if len(text.encode("utf-8")) > MAX_TEXT_BYTES:
        return f"text is over {MAX_TEXT_BYTES} bytes"
    if len(base64.b64encode(response)) > MAX_TEXT_BYTES:
        return f"the prediction is over {MAX_TEXT_BYTES * 3 // 4} bytes serialised"
    return ""


def to_columns(rows: Sequence[tuple[Entry, Vector]]) -> dict[str, list[Any]]:
    """`rows` as Milvus's column-based insert takes them: a list of values per field.

    pymilvus packs a column with one call per field where a row-based insert packs every
    field of every row on its own: for a batch of 40 exact-only rows 0.093 ms of the caller's
    CPU a row against 0.237 (bench/scripts/write_cost.py). The scope's four digests are
    made once per scope, not per row: a batch's rows mostly share a few scopes.
    """
    columns: dict[str, list[Any]] = {name: [] for name in ("id", "vector", *SCALARS)}
    digests: dict[Scope, tuple[str, str, str, str]] = {}
    for entry, _ in rows:
        tenant, model, version, params = entry.scope
        if problem := row_problem(entry.scope, entry.text, entry.response):
            raise ValueError(problem)
        keys = digests.get(entry.scope)
        if keys is None:
            keys = digests[entry.scope] = (
                scope_digest(entry.scope),
                digest("tenant", tenant),
                digest("model", model),
                digest("version", model, version),
            )
        columns["id"].append(entry_id(entry.key))
        for name, value in zip(DIGESTS, keys, strict=True):
            columns[name].append(value)
        columns["tenant"].append(tenant)
        columns["model"].append(model)
        columns["model_version"].append(version)
        columns["params"].append(params)
        columns["text"].append(entry.text)
        columns["response"].append(base64.b64encode(entry.response).decode("ascii"))
        columns["created_at"].append(entry.created_at)
        columns["expires_at"].append(entry.expires_at)
    if rows:  # one conversion for the batch: pymilvus extends the field with plain floats
        columns["vector"] = np.stack([v for _, v in rows]).astype(np.float32).tolist()
    return columns


def to_row(entry: Entry, vector: Vector) -> dict[str, Any]:
    """One entry as a row (a row-based upsert's form): `to_columns`' fields, one value each."""
    return {name: values[0] for name, values in to_columns([(entry, vector)]).items()}


def from_hit(hit: Any) -> tuple[Entry, float]:
    row = dict(hit["entity"])
    row["id"] = hit["id"]
    return from_row(row), float(hit["distance"])


def from_row(row: dict[str, Any]) -> Entry:
    return Entry(
        key=str(row["id"]),
        scope=(row["tenant"], row["model"], row["model_version"], row["params"]),
        text=row["text"],
        response=base64.b64decode(row["response"]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
    )
