"""The cache's settings: read once at start-up from HOPLINE_* variables and flags
(hopline.runtime.config), frozen after."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from hopline.cache.store import is_local
from hopline.runtime.config import ServerConfig, env_field, listen_field, metrics_port_field


class ExactFallback(enum.StrEnum):
    """Which lookups read Milvus by key when the in-memory exact index has no entry."""

    OFF = "off"
    SEMANTIC = "semantic"  # semantic-policy lookups, beside their embedding
    ALL = "all"  # exact-only ones too


@dataclasses.dataclass(frozen=True)
class CacheConfig(ServerConfig):
    listen: str = listen_field("cache")
    metrics_port: int = metrics_port_field("cache")
    uri: str = env_field(
        "HOPLINE_CACHE_URI",
        ".hopline/cache.db",
        "Milvus: a file path runs embedded milvus-lite, http(s)://host:port a Milvus server",
    )
    work_dir: str = env_field(
        "HOPLINE_CACHE_DIR", ".hopline", "where the built embedding encoder is kept"
    )
    index_type: str = env_field(
        "HOPLINE_CACHE_INDEX",
        "AUTOINDEX",
        "Milvus vector index for a new collection (AUTOINDEX: exact on milvus-lite 2.5, the "
        "server's choice on a Milvus server)",
    )
    milvus_timeout_s: float = env_field(
        "HOPLINE_CACHE_MILVUS_TIMEOUT_S", 5.0, "bound on each Milvus call, connecting included"
    )
    max_entries: int = env_field(
        "HOPLINE_CACHE_MAX_ENTRIES", 1_000_000, "bound per (tenant, model) when a model sets none"
    )
    default_ttl_s: float = env_field(
        "HOPLINE_CACHE_TTL_S", 3600.0, "time to live when a store names none"
    )
    sweep_interval_s: float = env_field(
        "HOPLINE_CACHE_SWEEP_S", 30.0, "how often expired entries are deleted"
    )
    flush_interval_ms: float = env_field(
        "HOPLINE_CACHE_FLUSH_MS", 5.0, "how long stores gather before one batched write"
    )
    max_pending: int = env_field(
        "HOPLINE_CACHE_MAX_PENDING", 10_000, "stores waiting for Milvus before new ones are refused"
    )
    agreement_margin: float = env_field(
        "HOPLINE_CACHE_AGREEMENT_MARGIN",
        0.05,
        "a semantic hit is refused when an entry within this much below the threshold "
        "carries another answer",
    )
    exact_index: bool = env_field(
        "HOPLINE_CACHE_EXACT_INDEX",
        True,
        "answer exact lookups from an in-memory index rebuilt from Milvus at start-up "
        "(false: read Milvus by key on every exact lookup, for several cache replicas over one "
        "Milvus server that must see each other's invalidations)",
    )
    exact_index_max_entries: int = env_field(
        "HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES",
        2_000_000,
        "bound on the exact index as a whole (about 1 KiB an entry); past it the entries put "
        "longest ago leave the index, not Milvus",
    )
    exact_fallback: ExactFallback = env_field(
        "HOPLINE_CACHE_EXACT_FALLBACK",
        ExactFallback.SEMANTIC,
        "on an exact-index miss, also read Milvus by key: 'semantic' (semantic-policy lookups, "
        "at the same time as their embedding), 'all' (exact-only ones too) or 'off'",
    )
    embed_threads: int = env_field(
        "HOPLINE_CACHE_EMBED_THREADS", 0, "ONNX Runtime threads for the embedder (0: all cores)"
    )
    verify_state: str = env_field(
        "HOPLINE_CACHE_VERIFY_STATE",
        "",
        "SQLite file of verified-hit evidence (default: beside a milvus-lite file, else "
        "cache-verify.sqlite in HOPLINE_CACHE_DIR)",
    )

    def verify_state_path(self) -> Path:
        if self.verify_state:
            return Path(self.verify_state)
        if is_local(self.uri):
            return Path(self.uri).with_suffix(".verify.sqlite")
        return Path(self.work_dir) / "cache-verify.sqlite"

    peer_poll_ms: float = env_field(
        "HOPLINE_CACHE_PEER_POLL_MS",
        100.0,
        "with a Milvus server, how often this replica applies the other replicas' "
        "invalidations (cache/shared_invalidations.py: the bound on how stale they can be); "
        "while on, every exact-index miss reads Milvus (another replica's stores); 0: off",
    )
