"""The gateway's settings, read once at start-up from HOPLINE_* variables and flags
(hopline.runtime.config; `hopline serve gateway --help` and README.md's table list them)."""

from __future__ import annotations

import dataclasses

from hopline.gateway.speculation import SpeculationMode
from hopline.runtime.api_keys import API_KEYS_ENV
from hopline.runtime.config import (
    AT_LEAST_ONE,
    POSITIVE,
    Range,
    ServerConfig,
    env_field,
    listen_field,
    metrics_port_field,
    model_refresh_field,
    upstream_field,
)
from hopline.runtime.ports import port_problem
from hopline.runtime.service_table import spec

MAX_ATTEMPTS_CAP = 5  # gRPC's own limit on a retry policy's maxAttempts (it clamps higher)
MAX_RETRY_TOKENS = 1000  # gRPC's own limit on retryThrottling's maxTokens


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    listen: str = listen_field("gateway")
    metrics_port: int = metrics_port_field("gateway")
    tokenizer_addr: str = upstream_field("tokenizer")
    cache_addr: str = upstream_field("cache")
    inference_addr: str = upstream_field("inference")
    postprocess_addr: str = upstream_field("postprocess")
    # A field of this name makes `hopline serve` a supervisor of that many processes.
    worker_processes: int = env_field(
        "HOPLINE_GATEWAY_WORKERS",
        1,
        "gateway processes sharing its port (SO_REUSEPORT, Linux), each with its own event "
        "loop: for machines with cores to spare, where one loop is the limit; the supervisor "
        "serves every worker's /metrics merged on HOPLINE_METRICS_PORT",
        valid=Range(high=256),  # 2**63 forked workers without end
    )
    default_model: str = env_field(
        "HOPLINE_DEFAULT_MODEL", "support-intents", "model used when a request names none"
    )
    local_exact_entries: int = env_field(
        "HOPLINE_GATEWAY_EXACT_ENTRIES",
        10_000,
        "exact cache entries the gateway keeps to answer repeats without a hop (0: none); "
        "served only while its invalidation watch on the cache is live",
    )
    key_mirror_keys: int = env_field(
        "HOPLINE_GATEWAY_KEY_MIRROR",
        2_000_000,
        "exact keys the gateway mirrors from the cache (about 90 bytes each), so a miss of an "
        "exact-only model skips the Lookup (0: always look up)",
    )
    # 1 against 2, five processes on 2 cores, alternated 10 s rounds (stop 52): c=32 better in 9
    # of 12 rounds (medians 377.0 / 332.3, 375.0 / 364.4, 336.4 / 323.0 rps over three runs);
    # two connections put the mesh in a mode of smaller inference batches (0.19 Infer RPCs a
    # request against 0.14) in 5 of 12 rounds, one in 1 of 12. c=1: better in 4 of 8 rounds
    # (p50 medians 8.21 / 8.81 and 7.63 / 7.48 ms). A `dns:///` name (headless Service) gives
    # one channel a connection per replica; only an upstream behind one virtual IP needs more.
    channels_per_upstream: int = env_field(
        "HOPLINE_CHANNELS_PER_UPSTREAM",
        1,
        "connections the gateway keeps to each upstream address (more for an upstream behind "
        "one virtual IP, where each connection reaches one replica)",
        valid=Range(1.0, high=64),  # 2**63 hung the start making channels
    )
    # Measured through the gateway on 2 cores, full CLINC150 eval (15k entries, a store after
    # every miss): semantic lookups p99 25 ms, p50 17 ms. 40 ms leaves room for a busier
    # machine without letting a sick cache add more than a model run to every request.
    cache_budget_ms: float = env_field(
        "HOPLINE_CACHE_BUDGET_MS",
        40.0,
        "a cache lookup slower than this fails open",
        valid=POSITIVE,
    )
    cache_breaker_failures: int = env_field(
        "HOPLINE_CACHE_BREAKER_FAILURES",
        5,
        "consecutive cache failures that open the circuit",
        valid=AT_LEAST_ONE,
    )
    cache_breaker_cooldown_s: float = env_field(
        "HOPLINE_CACHE_BREAKER_COOLDOWN_S", 5.0, "how long an open circuit skips the cache"
    )
    api_keys: str = env_field(
        API_KEYS_ENV, "", "JSON file of API key -> tenant; when set, a key is required"
    )
    upstream_timeout_s: float = env_field(
        "HOPLINE_UPSTREAM_TIMEOUT_S",
        10.0,
        "the longest a request may take, its hops together: the client's deadline if sooner",
        valid=POSITIVE,
    )
    max_text_bytes: int = env_field(
        "HOPLINE_MAX_TEXT_BYTES", 16384, "longest text accepted, in UTF-8 bytes", valid=AT_LEAST_ONE
    )
    stream_max_in_flight: int = env_field(
        "HOPLINE_STREAM_MAX_IN_FLIGHT",
        64,
        "requests of one PredictStream answered at once; past it the gateway stops reading",
        valid=AT_LEAST_ONE,
    )
    max_streams: int = env_field(
        "HOPLINE_GATEWAY_MAX_STREAMS",
        4096,
        "streams (PredictStream, ModelStreamInfer) held open at once; past it a new one is "
        "refused RESOURCE_EXHAUSTED, "
        "and once a second tenant has opened one no tenant holds more than half (0: no limit)",
        valid=Range(high=1_000_000),
    )
    model_refresh_s: float = model_refresh_field(
        "how often the model list is re-read from inference"
    )
    upstream_retry_attempts: int = env_field(
        "HOPLINE_UPSTREAM_RETRY_ATTEMPTS",
        3,
        "attempts per upstream call, the first included, when an attempt is UNAVAILABLE "
        "(0 or 1: no retries; at most 5); each retry takes the next replica, within the "
        "call's deadline",
        valid=Range(high=MAX_ATTEMPTS_CAP),
    )
    upstream_retry_backoff_ms: float = env_field(
        "HOPLINE_UPSTREAM_RETRY_BACKOFF_MS",
        10.0,
        "base of the randomised wait before the first retry; doubles per retry",
    )
    upstream_retry_max_backoff_ms: float = env_field(
        "HOPLINE_UPSTREAM_RETRY_MAX_BACKOFF_MS", 100.0, "cap on the wait between retries"
    )
    upstream_retry_tokens: int = env_field(
        "HOPLINE_UPSTREAM_RETRY_TOKENS",
        0,
        "retry budget per upstream: a failed attempt spends a token, retries stop while "
        "fewer than half are left (0: twice HOPLINE_GATEWAY_MAX_IN_FLIGHT, at most 1000, so "
        "every call in flight on a replica that dies can still be retried)",
        valid=Range(high=MAX_RETRY_TOKENS),  # past it gRPC's limit took 1000, unsaid
    )
    upstream_hedge_attempts: int = env_field(
        "HOPLINE_UPSTREAM_HEDGE_ATTEMPTS",
        3,
        "attempts per stage call when its replica holds it unanswered past the hedging delay, "
        "the first included (0 or 1: no hedging; at most 5); each on the next replica, the "
        "first reply taken (gateway/hedging.py)",
        valid=Range(high=MAX_ATTEMPTS_CAP),
    )
    upstream_hedge_min_ms: float = env_field(
        "HOPLINE_UPSTREAM_HEDGE_MIN_MS",
        100.0,
        "the least a stage call is given before a hedge; the delay is 4 times the stage's "
        "recent p99 where that is longer",
        valid=POSITIVE,
    )
    batch_max_rows: int = env_field(
        "HOPLINE_GATEWAY_BATCH_MAX_ROWS",
        32,
        "misses that wait for a busy stage go to it together, up to this many rows per RPC "
        "(1: one RPC per request); a lone request never waits; a co-located stage is called "
        "per request (gateway/stage_batching.py)",
        valid=AT_LEAST_ONE,
    )
    # 1: one RPC per stage and model on its way, the rest wait for it and go together in the
    # next. At 2, most tokenize and postprocess calls (about a millisecond each) found a free
    # slot and went alone: 0.78 Tokenize, 0.53 Postprocess and 0.35 Infer RPCs per request at
    # 32 callers (five processes, 2 cores) against 0.46, 0.28 and 0.17 at 1. Alternated rounds,
    # c=32 miss: five processes 134.4 -> 158.7 and 141.8 -> 167.5 rps (p99 447 -> 350 ms),
    # co-located 167.1 -> 175.5; open loop at 120 rps co-located p99 192 -> 170 ms. A lone
    # request still goes at once, so c=1 is the same code path. Co-located stages are not
    # batched by the gateway (GatewayStages.over).
    batch_in_flight: int = env_field(
        "HOPLINE_GATEWAY_BATCH_IN_FLIGHT",
        1,
        "RPCs per stage, model and replica the stage's address names on their way before "
        "further misses queue into one batch",
        valid=AT_LEAST_ONE,
    )
    batch_gather: bool = env_field(
        "HOPLINE_GATEWAY_BATCH_GATHER",
        True,
        "while other requests are in the gateway, a miss that finds a stage's slot free waits "
        "up to HOPLINE_GATEWAY_BATCH_LINGER_MS for the misses that reach it meanwhile, so they "
        "share the RPC (stages in a process of their own; a lone request never waits)",
    )
    batch_linger_ms: float = env_field(
        "HOPLINE_GATEWAY_BATCH_LINGER_MS",
        1.0,
        "how long a gathering miss waits for company (0: one event-loop turn)",
    )
    # Each StoreBatch wakes the cache process, and on 2 cores its CPU stalls the model's
    # threads mid-operator. Co-located, c=1 miss, 4 alternated rounds: linger 50 / 150 / 300 /
    # 500 ms gave p50 14.72 / 13.55 / 13.43 / 12.84 ms (model compute 9.44 -> 7.86 ms; cache
    # bypassed altogether 11.78); c=32: 171.3 -> 181.9 rps at 500 against 50.
    store_linger_ms: float = env_field(
        "HOPLINE_GATEWAY_STORE_LINGER_MS",
        500.0,
        "how long a cache store waits for others to share its StoreBatch call (0: stores "
        "share a call only while the last is on its way); answers are held by the gateway "
        "meanwhile, so only other gateways see a store this much later",
    )
    speculate: SpeculationMode = env_field(
        "HOPLINE_GATEWAY_SPECULATE",
        SpeculationMode.AUTO,
        "start inference beside the cache lookup: auto (while the model's recent lookups hit "
        "less than HOPLINE_GATEWAY_SPECULATE_MAX_HIT_RATE), on, off",
    )
    # Measured in the closing note of the stop that added it (co-located, 2 cores): one
    # encoder run per miss instead of two, in the cache and the model at once.
    share_embeddings: bool = env_field(
        "HOPLINE_GATEWAY_SHARE_EMBEDDINGS",
        True,
        "run a model whose head_embedder is the cache's encoder from the lookup's query "
        "embedding (the head alone) instead of its token ids; such misses are not speculated",
    )
    speculate_max_hit_rate: float = env_field(
        "HOPLINE_GATEWAY_SPECULATE_MAX_HIT_RATE",
        0.2,
        "with speculate=auto: share of cache-service lookups hitting above which a model's "
        "misses wait for the lookup before inference (each hit wastes a started inference)",
        valid=Range(high=1),
    )
    upstream_retry_token_ratio: float = env_field(
        "HOPLINE_UPSTREAM_RETRY_TOKEN_RATIO",
        0.1,
        "tokens a successful call gives back to the retry budget",
    )
    # The front door: tenants come from API keys, so no client certificate by default.
    tls_peers: str = env_field(
        "HOPLINE_GATEWAY_TLS_PEERS",
        "",
        "client certificate names the gateway requires (empty: none; API keys name tenants)",
    )
    # Admission control (gateway/admission.py).
    max_in_flight: int = env_field(
        "HOPLINE_GATEWAY_MAX_IN_FLIGHT",
        256,
        "requests worked on at once; past it RESOURCE_EXHAUSTED at once (0: no limit)",
    )
    tenant_min_in_flight: int = env_field(
        "HOPLINE_GATEWAY_TENANT_MIN_IN_FLIGHT",
        32,
        "while several tenants send, each may hold HOPLINE_GATEWAY_MAX_IN_FLIGHT / tenants "
        "requests in flight, at least this many, and once a second tenant has sent no tenant "
        "holds the last this-many places (0: no tenant's share)",
    )
    cache_adaptive: bool = env_field(
        "HOPLINE_CACHE_ADAPTIVE",
        True,
        "cut the lookup budget to what the deadline leaves, skip lookups while most overrun it",
    )
    # Ejection of a failing replica (gateway/resilience.py:ejection_service_config).
    upstream_eject_failure_percent: int = env_field(
        "HOPLINE_UPSTREAM_EJECT_FAILURE_PERCENT",
        50,
        "a replica whose calls fail this often over an interval is ejected (0: never)",
        valid=Range(high=100),
    )
    upstream_eject_min_requests: int = env_field(
        "HOPLINE_UPSTREAM_EJECT_MIN_REQUESTS",
        10,
        "calls a replica needs in an interval (per gateway channel) to be judged",
    )
    upstream_eject_interval_s: float = env_field(
        "HOPLINE_UPSTREAM_EJECT_INTERVAL_S", 1.0, "how often replicas are judged", valid=POSITIVE
    )
    upstream_eject_base_s: float = env_field(
        "HOPLINE_UPSTREAM_EJECT_BASE_S",
        10.0,
        "first ejection's length; each further ejection of a replica lasts longer",
        valid=POSITIVE,
    )

    def address_problems(self) -> list[str]:
        """Upstream addresses that are empty or whose port gRPC would take modulo 65536
        (runtime/ports.py), each named by its variable: such a gateway would wait for an
        upstream for ever."""
        addrs = {
            "tokenizer": self.tokenizer_addr,
            "cache": self.cache_addr,
            "inference": self.inference_addr,
            "postprocess": self.postprocess_addr,
        }
        problems = [
            f"{spec(name).addr_env}={problem}"
            for name, addr in addrs.items()
            if (problem := port_problem(addr)) is not None
        ]
        # Its own address: a gateway that waited for itself for ever, or answered every
        # request INTERNAL "tokenize failed with UNIMPLEMENTED" (a settings probe).
        problems += [
            f"{spec(name).addr_env}={addr!r} is the gateway's own address (HOPLINE_GATEWAY_"
            f"ADDR): give the {name} service's"
            for name, addr in addrs.items()
            if addr.strip() == self.listen.strip() and not self.listen.endswith(":0")
        ]
        return problems
