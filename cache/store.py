"""The cache's store behind one small interface, so the servicer does not care where entries live.

The backend is cache/milvus_store.py's MilvusStore (the collection's rows: cache/milvus_rows.py).
Every read is filtered by the entry's scope and `expires_at > now`, so an expired or foreign
entry is never returned even before the sweeper deletes it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from hopline.cache.generations import Reclaimed
from hopline.cache.keys import digest, scope_matches
from hopline.runtime.config import SettingError


class EncoderBuildError(RuntimeError):
    """The embedding encoder could not be built where HOPLINE_CACHE_DIR says (here, not in
    cache/embedder.py: the command-line tools catch it without loading ONNX Runtime)."""


Vector = npt.NDArray[np.float32]
Scope = tuple[str, str, str, str]  # tenant, model, version, canonical parameters

# Loading a collection into Milvus's memory at start-up (HOPLINE_CACHE_LOAD_TIMEOUT_S):
# milvus-lite on 2 cores took 9.5 s for 200,000 rows and 66 s for 1,000,000.
LOAD_TIMEOUT_S = 600.0
# Rows per page when the exact index is rebuilt: Milvus's most. milvus-lite filters the whole
# collection for every page, so pages of 2,000 made the rebuild grow with the square of the
# rows (200,000: 7.2 s against 4.6 in pages of 16,384; 1,000,000 read as `live` reads them:
# 73 s in pages of 4,000, 27 s in pages of 16,384).
LIVE_PAGE = 16_384


class CacheStoreError(RuntimeError):
    """The store cannot be opened or used; the message says what to fix."""


class CacheSettingError(CacheStoreError, SettingError):
    """A cache setting the store cannot work with (a URI, a file, a bound): a typo, not an
    outage, so the service refuses to start with exit status 2, as for every setting."""


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    key: str
    scope: Scope
    text: str  # normalised
    response: bytes  # a serialised hopline.common.v1.Prediction
    created_at: float
    expires_at: float


class LookupConsistency(enum.StrEnum):
    """How a lookup's key query and search read Milvus (cache/tombstones.py says why)."""

    BOUNDED = "bounded"  # no wait for the server's time tick; recent deletes hidden by stones
    STRONG = "strong"  # waits for the next tick (proxy.timeTickInterval) on a Milvus server

    @property
    def milvus_level(self) -> str:
        return self.value.capitalize()


@dataclasses.dataclass(frozen=True)
class ScopeFilter:
    """Matches entries whose scope equals every non-empty field."""

    tenant: str = ""
    model: str = ""
    model_version: str = ""

    def is_empty(self) -> bool:
        return not (self.tenant or self.model or self.model_version)

    def matches(self, scope: Scope) -> bool:
        """Whether an entry of `scope` is one this filter names (empty fields match all)."""
        return scope_matches((self.tenant, self.model, self.model_version), scope)

    def expression(self) -> str:
        if self.model_version and not self.model:
            raise ValueError("a model version needs its model name")
        parts = []
        if self.tenant:
            parts.append(f'tenant_key == "{digest("tenant", self.tenant)}"')
        if self.model_version:
            parts.append(f'version_key == "{digest("version", self.model, self.model_version)}"')
        elif self.model:
            parts.append(f'model_key == "{digest("model", self.model)}"')
        return " and ".join(parts)


class CacheStore(Protocol):
    """What the cache servicer needs from a backend. Calls may block."""

    def get(self, key: str, now: float) -> Entry | None: ...

    def live(self, now: float, page: int = LIVE_PAGE) -> list[Entry]:
        """Every entry not expired at `now`, read in pages of `page` rows."""

    def vectors_of(self, scope: Scope, now: float) -> list[tuple[str, Vector]]:
        """Every live entry of `scope` with its vector (cache/vector_index.py's read-back)."""

    def search(
        self, vectors: Sequence[Vector], scope: Scope, now: float, limit: int
    ) -> list[list[tuple[Entry, float]]]:
        """For each vector, live entries of `scope`, nearest first, with their cosine
        similarity: one call for them all (cache/search_batching.py)."""

    def upsert(self, rows: Sequence[tuple[Entry, Vector]]) -> None: ...

    def delete(self, keys: Sequence[str]) -> int: ...

    def delete_scope(self, scope: ScopeFilter) -> int: ...

    def expire(self, now: float) -> int: ...

    def count(self, tenant: str = "", model: str = "") -> int: ...

    def oldest(self, tenant: str, model: str, n: int) -> list[str]:
        """Keys of the `n` oldest entries of (tenant, model)."""

    def reclaim(self, now: float) -> Reclaimed | None:
        """Frees what deleted rows still hold, when the backend needs it; None when not due."""

    def stores_wait(self) -> bool:
        """Whether new stores should wait before `upsert` (a reclaim's record of the writes
        made during its copy is full); they stay pending meanwhile."""

    def close(self) -> None: ...
