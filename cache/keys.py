"""Cache keys. Scope is part of every key by construction, never an optional filter."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata

from hopline.protos.hopline.common.v1 import common_pb2

_SPACE = re.compile(r"\s+")


class ScopeError(ValueError):
    """A scope missing a field every key needs."""


def normalise_text(text: str) -> str:
    """Texts that differ only in Unicode form, case or whitespace get one key.

    Safe for the uncased MiniLM tokenizer, which lower-cases and splits on whitespace:
    such texts tokenize identically, so their answers are identical.
    """
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip().casefold()


def scope_tuple(scope: common_pb2.Scope) -> tuple[str, str, str, str]:
    """(tenant, model, version, canonical parameters); every field required."""
    missing = [f for f in ("tenant", "model", "model_version") if not getattr(scope, f)]
    if missing:
        raise ScopeError(f"scope needs {', '.join(missing)}")
    if not scope.parameters:  # the common case, and what json.dumps would have written
        return scope.tenant, scope.model, scope.model_version, "{}"
    params = json.dumps(dict(sorted(scope.parameters.items())), separators=(",", ":"))
    return scope.tenant, scope.model, scope.model_version, params


def scope_matches(wanted: tuple[str, str, str], scope: tuple[str, ...]) -> bool:
    """Whether `scope` (tenant, model, version, ...) is one an invalidation naming `wanted`
    (tenant, model, version; an empty field names all) covers."""
    return all(not want or want == got for want, got in zip(wanted, scope[:3], strict=True))


def exact_key(scope: tuple[str, str, str, str], text: str) -> str:
    """SHA-256 over the scope and the normalised text, with unambiguous field separation."""
    doc = json.dumps([*scope, normalise_text(text)], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


def digest(*parts: str) -> str:
    """A hex SHA-256 over `parts`, used as a Milvus filter value.

    Filters only ever compare these hex digests and numbers, never user text, so no tenant
    or model name can change a filter expression (milvus-lite 2.5 has no filter templates).
    """
    doc = json.dumps(list(parts), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


def scope_digest(scope: tuple[str, str, str, str]) -> str:
    return digest("scope", *scope)
