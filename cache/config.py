"""The cache service's settings, read once at start-up from HOPLINE_CACHE_* variables and
flags (hopline.runtime.config; `hopline serve cache --help` and README.md's table list them)."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from hopline.cache.store import LOAD_TIMEOUT_S, LookupConsistency
from hopline.model.spin import Spin
from hopline.runtime.config import (
    AT_LEAST_ONE,
    POSITIVE,
    Range,
    ServerConfig,
    env_field,
    listen_field,
    metrics_port_field,
)

# A Milvus server's access settings, named here once (cache/milvus_access.py checks them).
MILVUS_TOKEN_ENV = "HOPLINE_CACHE_MILVUS_TOKEN_FILE"
MILVUS_CA_ENV = "HOPLINE_CACHE_MILVUS_CA"
MILVUS_CERT_ENV = "HOPLINE_CACHE_MILVUS_CLIENT_CERT"
MILVUS_KEY_ENV = "HOPLINE_CACHE_MILVUS_CLIENT_KEY"
MILVUS_DB_ENV = "HOPLINE_CACHE_MILVUS_DB"


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
        "Milvus: a file path ending in .db runs embedded milvus-lite, http(s)://host:port "
        "(or tcp://host:port, unix:///PATH) a Milvus server; any other is refused at start",
    )
    # A Milvus server that authenticates or encrypts (cache/milvus_access.py).
    milvus_token_file: str = env_field(
        MILVUS_TOKEN_ENV,
        "",
        "file holding the token a Milvus server with authentication takes ('user:password' or "
        "an API key; unset: none sent)",
    )
    milvus_ca: str = env_field(
        MILVUS_CA_ENV,
        "",
        "PEM CA that verifies an https:// Milvus server (unset: the system's roots)",
    )
    milvus_client_cert: str = env_field(
        MILVUS_CERT_ENV,
        "",
        "PEM certificate the cache presents to a Milvus server with mutual TLS (tlsMode 2)",
    )
    milvus_client_key: str = env_field(
        MILVUS_KEY_ENV, "", "PEM private key of HOPLINE_CACHE_MILVUS_CLIENT_CERT"
    )
    milvus_db: str = env_field(
        MILVUS_DB_ENV,
        "",
        "the Milvus server's database the cache keeps its collections in (unset: the "
        "server's default one); `hopline cache milvus-user` makes it and bounds the cache's "
        "privileges to it",
    )
    work_dir: str = env_field(
        "HOPLINE_CACHE_DIR",
        ".hopline",
        "folder where the built embedding encoder is kept (made if missing; one that cannot "
        "be is refused at start)",
    )
    index_type: str = env_field(
        "HOPLINE_CACHE_INDEX",
        "AUTOINDEX",
        "Milvus vector index for a new collection (AUTOINDEX: exact on milvus-lite 2.5, the "
        "server's choice on a Milvus server)",
    )
    milvus_timeout_s: float = env_field(
        "HOPLINE_CACHE_MILVUS_TIMEOUT_S",
        5.0,
        "bound on each Milvus call, connecting included (a milvus-lite file's server gets 30 s "
        "to start)",
        valid=POSITIVE,
    )
    load_timeout_s: float = env_field(
        "HOPLINE_CACHE_LOAD_TIMEOUT_S",
        LOAD_TIMEOUT_S,
        "bound on loading the collection into Milvus's memory at start-up, which grows with "
        "its rows",
        valid=POSITIVE,
    )
    max_entries: int = env_field(
        "HOPLINE_CACHE_MAX_ENTRIES",
        1_000_000,
        "cap on every model's bound per (tenant, model), and the bound of a store naming none "
        "(the gateway's stores name their model's cache.max_entries: 100,000 when it sets "
        "none)",
        valid=AT_LEAST_ONE,
    )
    max_total_entries: int = env_field(
        "HOPLINE_CACHE_MAX_TOTAL_ENTRIES",
        0,
        "bound on a milvus-lite file's entries, every (tenant, model) together (its server, "
        "a child of this process, holds about 2.6 KiB a row in memory); past it the (tenant, "
        "model)s holding the most give up their oldest; 0: none",
    )
    default_ttl_s: float = env_field(
        "HOPLINE_CACHE_TTL_S",
        3600.0,
        "time to live of a store naming none (the gateway's stores name their model's "
        "cache.ttl_s: 3600 s when it sets none)",
        valid=POSITIVE,
    )
    sweep_interval_s: float = env_field(
        "HOPLINE_CACHE_SWEEP_S", 30.0, "how often expired entries are deleted", valid=POSITIVE
    )
    # Each batch costs a key query, an insert and a count in Milvus whatever its size, and
    # that CPU lands on the cores the model runs on. Misses one at a time (colocated, 2 cores,
    # two alternated rounds): 5 ms gave p50 10.7 and 7.8 ms, 30 ms 6.9-7.5, 100 ms 6.4 and 6.8;
    # 32 callers: 244/274, 279-303 and 292/298 rps. Later, with the key mirror (3 alternated
    # rounds, twice): 100 -> 300 ms moved c=1 p50 6.75 -> 6.54 and 6.93 -> 6.71 ms, p99 13.2
    # -> 12.3 and 13.6 -> 12.6 ms, c=32 218 -> 251 and 236 -> 249 rps; 1000 ms was no better
    # (245 rps, a longer tail). What it costs: a store waits up to this long to be durable and
    # visible to other replicas (this one serves it from the queue).
    flush_interval_ms: float = env_field(
        "HOPLINE_CACHE_FLUSH_MS", 300.0, "how long stores gather before one batched write"
    )
    max_pending: int = env_field(
        "HOPLINE_CACHE_MAX_PENDING",
        10_000,
        "stores waiting for Milvus before new ones are refused",
        valid=AT_LEAST_ONE,
    )
    agreement_margin: float = env_field(
        "HOPLINE_CACHE_AGREEMENT_MARGIN",
        0.05,
        "a semantic hit is refused when an entry within this much below the threshold "
        "carries another answer",
        valid=Range(high=1),
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
        "bound on the exact index as a whole (about 0.8 KiB an entry of a short text); past it "
        "the entries put longest ago leave the index, not Milvus",
        valid=AT_LEAST_ONE,
    )
    semantic_index: bool = env_field(
        "HOPLINE_CACHE_SEMANTIC_INDEX",
        True,
        "search a scope's vectors in memory, not in Milvus, while memory holds the scope whole "
        "(cache/vector_index.py; a milvus-lite file only, whose one writer is this process, "
        "and with the exact index)",
    )
    semantic_index_max_rows: int = env_field(
        "HOPLINE_CACHE_SEMANTIC_INDEX_MAX_ROWS",
        200_000,
        "vectors held in memory (1.5 KiB each at 384 dimensions); a scope that would pass it "
        "is searched in Milvus",
    )
    exact_fallback: ExactFallback = env_field(
        "HOPLINE_CACHE_EXACT_FALLBACK",
        ExactFallback.SEMANTIC,
        "on an exact-index miss, also read Milvus by key: 'semantic' (semantic-policy lookups, "
        "at the same time as their embedding), 'all' (exact-only ones too) or 'off'",
    )
    embed_threads: int = env_field(
        "HOPLINE_CACHE_EMBED_THREADS",
        0,
        "ONNX Runtime threads per embedder run (0: every core for a run alone, one core each "
        "for runs side by side)",
        valid=Range(high=1024),  # as HOPLINE_INFERENCE_THREADS
    )
    embed_workers: int = env_field(
        "HOPLINE_CACHE_EMBED_WORKERS",
        0,
        "embedder runs in parallel with HOPLINE_CACHE_EMBED_THREADS=0 (0: one per core)",
    )
    embed_spin: Spin = env_field(
        "HOPLINE_CACHE_EMBED_SPIN",
        Spin.RUN,
        "what the embedder's ONNX Runtime threads do between operators (as "
        "HOPLINE_INFERENCE_SPIN): 'off', 'run' or 'always'",
    )
    verify_state: str = env_field(
        "HOPLINE_CACHE_VERIFY_STATE",
        "",
        "SQLite file of verified-hit evidence on a milvus-lite file (default: beside it); "
        "with a Milvus server the evidence is kept there, shared by the replicas",
    )

    def verify_state_path(self) -> Path:
        if self.verify_state:
            return Path(self.verify_state)
        return Path(self.uri).with_suffix(".verify.sqlite")

    reclaim_ratio: float = env_field(
        "HOPLINE_CACHE_RECLAIM_RATIO",
        1.0,
        "milvus-lite keeps deleted rows in memory: once they reach this many times the live "
        "ones (and 1000), the live rows are copied to a fresh collection and the old one "
        "dropped (docs/cache.md); 0: never. A Milvus server compacts by itself",
    )
    lookup_consistency: LookupConsistency = env_field(
        "HOPLINE_CACHE_LOOKUP_CONSISTENCY",
        LookupConsistency.BOUNDED,
        "how lookups read Milvus: 'bounded' (no wait for a server's time tick; entries deleted "
        "within HOPLINE_CACHE_TOMBSTONE_S are hidden from the results) or 'strong' (waits for "
        "the server's next tick, proxy.timeTickInterval)",
    )
    tombstone_s: float = env_field(
        "HOPLINE_CACHE_TOMBSTONE_S",
        10.0,
        "how long a deleted entry or scope stays hidden from lookups' Milvus reads; keep it "
        "above the Milvus server's common.gracefulTime (5 s by default), the staleness bound "
        "of a bounded read",
    )
    peer_poll_ms: float = env_field(
        "HOPLINE_CACHE_PEER_POLL_MS",
        100.0,
        "with a Milvus server, how often this replica applies the other replicas' "
        "invalidations (cache/shared_invalidations.py: the bound on how stale they can be) "
        "and takes their verified-hit evidence (cache/shared_evidence.py); "
        "while on, every exact-index miss reads Milvus (another replica's stores); 0: off",
    )
    peer_stale_s: float = env_field(
        "HOPLINE_CACHE_PEER_STALE_S",
        10.0,
        "with a Milvus server, how long the other replicas' invalidations may go unread (Milvus "
        "not answering the poll) before this replica stops answering from memory: lookups read "
        "Milvus and the gateways' watch streams end, so their local exact tiers stop too "
        "(cache/peer_sync.py); more than two polls of HOPLINE_CACHE_PEER_POLL_MS; keep it above "
        "HOPLINE_CACHE_MILVUS_TIMEOUT_S so a slow poll that succeeds does not count",
        valid=POSITIVE,
    )
    search_batch_rows: int = env_field(
        "HOPLINE_CACHE_SEARCH_BATCH_ROWS",
        64,
        "semantic searches of one scope that wait while Milvus is busy go as one call of up "
        "to this many vectors (cache/search_batching.py); 1: each alone",
        valid=AT_LEAST_ONE,
    )
