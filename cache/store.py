"""Cache stores behind one small interface, so the servicer does not care where entries live.

MemoryStore is the exact tier for a single cache process; the Milvus store (semantic tier,
persistence) plugs in behind the same interface.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Entry:
    key: str
    scope: tuple[str, str, str, str]  # tenant, model, version, parameters
    text: str  # normalised
    response: bytes  # a serialised hopline.common.v1.Prediction
    created_at: float
    expires_at: float


@dataclass(frozen=True)
class ScopeFilter:
    """Matches entries whose scope equals every non-empty field."""

    tenant: str = ""
    model: str = ""
    model_version: str = ""

    def matches(self, scope: tuple[str, str, str, str]) -> bool:
        return all(
            not want or want == got
            for want, got in zip(
                (self.tenant, self.model, self.model_version), scope[:3], strict=True
            )
        )


class CacheStore(Protocol):
    def get(self, key: str, now: float) -> Entry | None: ...

    def put(self, entry: Entry) -> int:
        """Insert or replace; returns how many entries were evicted to make room."""

    def invalidate(self, scope: ScopeFilter | None, keys: list[str]) -> int: ...

    def expire(self, now: float) -> int: ...

    def __len__(self) -> int: ...


class MemoryStore:
    """Exact tier in process memory: absolute TTL, evicts the oldest insert when full."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, now: float) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at <= now:
                del self._entries[key]
                return None
            return entry

    def put(self, entry: Entry) -> int:
        with self._lock:
            self._entries.pop(entry.key, None)
            self._entries[entry.key] = entry
            evicted = 0
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                evicted += 1
            return evicted

    def invalidate(self, scope: ScopeFilter | None, keys: list[str]) -> int:
        with self._lock:
            doomed = {k for k in keys if k in self._entries}
            if scope is not None:
                doomed |= {k for k, e in self._entries.items() if scope.matches(e.scope)}
            for key in doomed:
                del self._entries[key]
            return len(doomed)

    def expire(self, now: float) -> int:
        with self._lock:
            doomed = [k for k, e in self._entries.items() if e.expires_at <= now]
            for key in doomed:
                del self._entries[key]
            return len(doomed)

    def __len__(self) -> int:
        return len(self._entries)
