"""Per-service view of the model repository: loaded models, version resolution, rescans.

A version built while the services run is picked up on first use: an unknown name or
version triggers a rescan of the repository (at most once per `rescan_interval_s`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from hopline.model.repository import ModelConfig, ModelNotFoundError, ModelRepository

T = TypeVar("T")
log = logging.getLogger("hopline.model.registry")


class ModelRegistry(Generic[T]):
    def __init__(
        self,
        repo: ModelRepository,
        loader: Callable[[ModelConfig], T],
        *,
        rescan_interval_s: float = 1.0,
    ) -> None:
        self._repo = repo
        self._loader = loader
        self._loaded: dict[tuple[str, str], tuple[ModelConfig, T]] = {}
        self._latest: dict[str, str] = {}
        self._rescan_interval_s = rescan_interval_s
        self._last_scan = 0.0
        self._lock = threading.Lock()

    def load_all(self) -> list[ModelConfig]:
        """Load every version in the repository; used at start-up, before SERVING."""
        with self._lock:
            self._scan()
        return [cfg for cfg, _ in self._loaded.values()]

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        for name in self._repo.names():
            versions = self._repo.versions(name)
            for version in versions:
                if (name, version) not in self._loaded:
                    cfg = self._repo.resolve(name, version)
                    self._loaded[(name, version)] = (cfg, self._loader(cfg))
                    log.info("model loaded", extra={"model": name, "version": version})
            self._latest[name] = versions[-1]

    def _lookup(self, name: str, version: str) -> tuple[ModelConfig, T] | None:
        resolved = version or self._latest.get(name, "")
        return self._loaded.get((name, resolved))

    def get(self, name: str, version: str = "") -> tuple[ModelConfig, T]:
        found = self._lookup(name, version)
        if found is not None:
            return found
        with self._lock:
            if time.monotonic() - self._last_scan >= self._rescan_interval_s:
                self._scan()
            found = self._lookup(name, version)
        if found is None:
            self._repo.resolve(name, version)  # raises with the repository's own message
            raise ModelNotFoundError(f"model {name!r} version {version!r} is not loaded")
        return found

    def loaded(self) -> list[tuple[ModelConfig, T]]:
        return sorted(self._loaded.values(), key=lambda m: m[0].key)

    def models(self) -> list[ModelConfig]:
        return [cfg for cfg, _ in sorted(self._loaded.values(), key=lambda m: m[0].key)]
