"""Every span name and `hopline.` span attribute hopline emits, in one place.

Code refers to these constants rather than to string literals; a test walks the package's
source and fails on a span name or attribute key that is not declared here, and another
checks docs/observability.md lists exactly these. Attribute values are OpenTelemetry
primitives (str, bool, int, float).
"""

from __future__ import annotations

# -- attributes -------------------------------------------------------------------------------

MODEL = "hopline.model"
MODEL_VERSION = "hopline.model_version"
TENANT = "hopline.tenant"
CACHE_OUTCOME = "hopline.cache.outcome"
CACHE_SIMILARITY = "hopline.cache.similarity"
CACHE_COALESCED = "hopline.cache.coalesced"
CACHE_LOCAL = "hopline.cache.local"
CACHE_KNOWN_MISS = "hopline.cache.known_miss"
SPECULATIVE = "hopline.speculative"
CACHE_EMBEDDING_USED = "hopline.cache.embedding_used"
HEAD_ONLY = "hopline.head_only"
CACHE_SKIP_REASON = "hopline.cache.skip_reason"
ADMISSION_REFUSED = "hopline.admission.refused"
ADMISSION_PROBE = "hopline.admission.probe"
CACHE_CANDIDATES = "hopline.cache.candidates"
CACHE_SEARCH_ROWS = "hopline.cache.search_rows"
CACHE_SEARCH_IN = "hopline.cache.search_in"
CACHE_VERIFY_DECISION = "hopline.cache.verify.decision"
CACHE_VERIFY_THRESHOLD = "hopline.cache.verify.threshold"
CACHE_VERIFY_AGREED = "hopline.cache.verify.agreed"
CACHE_ENTRIES = "hopline.cache.entries"
BATCH_SIZE = "hopline.batch_size"
TOKENS = "hopline.tokens"
HOP = "hopline.hop"
DELAY_MS = "hopline.test_delay_ms"
STREAM_MESSAGES_SENT = "hopline.stream.messages_sent"
STREAM_MESSAGE_ID = "hopline.stream.message_id"
TEXT_INDEX = "hopline.text_index"
HEDGE_ATTEMPTS = "hopline.hedge.attempts"

ATTRIBUTES: dict[str, str] = {
    MODEL: "model name the request resolved to",
    MODEL_VERSION: "model version the request resolved to",
    TENANT: "tenant the request ran as (from its authenticated identity where there is one)",
    CACHE_OUTCOME: "exact, semantic, miss, fail_open or skipped",
    CACHE_SIMILARITY: "cosine similarity of the entry a hit served (1 for exact)",
    CACHE_COALESCED: "this miss waited for another identical request's inference",
    CACHE_LOCAL: "the gateway's local exact tier answered: no hop to the cache",
    CACHE_KNOWN_MISS: "the gateway's key mirror vouched for the miss: no lookup was sent",
    SPECULATIVE: "inference started beside the cache lookup (gateway/speculation.py)",
    CACHE_EMBEDDING_USED: "the model ran its head on the cache lookup's embedding: one encoder "
    "run for the miss, not two",
    HEAD_ONLY: "the run was the classifier head alone, on embeddings the caller sent",
    CACHE_SKIP_REASON: "why the gateway skipped the cache lookup: deadline or overloaded",
    ADMISSION_REFUSED: "why the gateway refused the request at once: in_flight or deadline",
    ADMISSION_PROBE: "true when the request's deadline looked too short for a model answer "
    "and it went through anyway, as one such request in gateway/admission.py's MIN_PROBE_EVERY "
    "does, to measure the path again",
    CACHE_CANDIDATES: "entries the search returned for verification and agreement",
    CACHE_SEARCH_ROWS: "searches that shared this one's call, itself included (1: alone)",
    CACHE_SEARCH_IN: "where the scope was searched: memory (cache/vector_index.py) or milvus",
    CACHE_VERIFY_DECISION: "a verified-hit rule's decision: serve, serve_and_verify, "
    "verify_first or miss (cache/verify.py)",
    CACHE_VERIFY_THRESHOLD: "the threshold the rule applied to this candidate's answer",
    CACHE_VERIFY_AGREED: "whether the model's answer equalled the cached candidate's",
    CACHE_ENTRIES: "entries in one batched Milvus write",
    BATCH_SIZE: "texts in the model or embedder run",
    TOKENS: "tokens of the request's texts before padding",
    HOP: "the upstream service a gateway client span calls",
    DELAY_MS: "test-only delay injected into this RPC (HOPLINE_TEST_DELAY_MS)",
    STREAM_MESSAGES_SENT: "responses a streaming RPC sent before it ended (on its server span)",
    STREAM_MESSAGE_ID: "the client's id of one message on a stream (PredictStreamRequest.id)",
    TEXT_INDEX: "which element of a ModelInfer's text input a `gateway.infer_text` span is",
    HEDGE_ATTEMPTS: "attempts of a stage call whose replica held it past the hedging delay, "
    "the first included (gateway/hedging.py)",
}

# -- spans (server spans are named after their RPC, e.g. hopline.gateway.v1.GatewayService/Predict)

SPAN_TOKENIZE = "tokenize"
SPAN_CACHE_LOOKUP = "cache_lookup"
SPAN_INFERENCE = "inference"
SPAN_POSTPROCESS = "postprocess"
SPAN_CACHE_STORE = "cache_store"
SPAN_INFERENCE_QUEUE = "inference.queue"
SPAN_INFERENCE_RUN = "inference.run"
SPAN_CACHE_EXACT = "cache.exact_read"
SPAN_CACHE_EMBED = "cache.embed"
SPAN_CACHE_SEARCH = "cache.search"
SPAN_CACHE_WRITE = "cache.write"
SPAN_CACHE_VERIFY = "cache_verify"
SPAN_STREAM_MESSAGE = "gateway.stream_message"
SPAN_STAGE_BATCH = "gateway.stage_batch"
SPAN_LIST_MODELS = "list_models"
SPAN_INFER_TEXT = "gateway.infer_text"
SPAN_COALESCED_WAIT = "gateway.coalesced_wait"

SPANS: dict[str, str] = {
    SPAN_TOKENIZE: "gateway client span: the call to the tokenizer",
    SPAN_CACHE_LOOKUP: "gateway client span: the cache lookup (bounded by the lookup budget)",
    SPAN_INFERENCE: "gateway client span: the call to inference",
    SPAN_POSTPROCESS: "gateway client span: the call to postprocess",
    SPAN_CACHE_STORE: "gateway client span: the asynchronous store after a miss (after the reply)",
    SPAN_INFERENCE_QUEUE: "inference: waiting for a model run to start",
    SPAN_INFERENCE_RUN: "inference: the model's own run",
    SPAN_CACHE_EXACT: "cache: the exact-tier read (pending buffer or Milvus key query)",
    SPAN_CACHE_EMBED: "cache: the query's embedding (may be shared with other lookups' batch)",
    SPAN_CACHE_SEARCH: "cache: the scope-filtered vector search, in memory or in Milvus",
    SPAN_CACHE_WRITE: "cache: one batched Milvus write; its own trace, linked to the stores",
    SPAN_CACHE_VERIFY: "gateway client span: the model's answer reported for a verified "
    "candidate (after the reply)",
    SPAN_STAGE_BATCH: "gateway: one RPC carrying several requests' rows to a stage "
    "(`hopline.hop` says which); in the first request's trace, linked from every request's hop "
    "span",
    SPAN_STREAM_MESSAGE: "gateway: one request on a PredictStream, under the stream's server "
    "span; its hops' client spans are its children",
    SPAN_INFER_TEXT: "gateway: one text of a KServe ModelInfer, under its server span; that "
    "text's hops and cache outcome are on it and under it",
    SPAN_COALESCED_WAIT: "gateway: a miss waiting for an identical one's inference already "
    "under way; linked to the span that inference runs under, in that request's trace",
    SPAN_LIST_MODELS: "gateway client span: the model list read again for a request naming a "
    "model or version the gateway does not know (the inference service's ListModels)",
}
