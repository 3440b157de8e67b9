"""One validated text on its way through the gateway: what the steps of predict_text share.

GatewayService.predict_text builds one PredictCall and hands it from step to step; each step
reads what it needs (scope, key, cache mode) and writes what it found (the reply's cache
info, timings, whether the local tier answered, why the cache failed open).

It also holds the checks on what a request may say before a PredictCall is built: `clip` (a
client's string as an error message may echo it) and `check_cache_mode` (proto3 enums are
open: any number arrives).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from typing import Any

import grpc

from hopline.cache.keys import answer_parameters, normalise_text, normalised_key, scope_tuple
from hopline.gateway.errors import RequestError
from hopline.observability.tracing import current_trace_id
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2

CACHE_MODES = tuple(
    (number, name)
    for name, number in common_pb2.CacheMode.items()
    if number != common_pb2.CACHE_MODE_UNSPECIFIED
)


ScopeTuple = tuple[str, str, str, str]


class _Scopes:
    """The Scope of each (tenant, model, version, digest, top_k) a request has named, with its
    canonical tuple, built once: a Scope with a parameter map cost about 10 us of a served
    gateway's request (py-spy, exact repeats), and its tuple a JSON encoding per miss. The
    messages are shared between requests, so nothing may write to them (requests copy them
    into the messages they send)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._scopes: OrderedDict[
            tuple[str, str, str, str, int], tuple[common_pb2.Scope, ScopeTuple]
        ] = OrderedDict()

    def get(
        self, tenant: str, info: inference_pb2.ModelInfo, top_k: int
    ) -> tuple[common_pb2.Scope, ScopeTuple]:
        memo = (tenant, info.name, info.version, info.digest, top_k)
        found = self._scopes.get(memo)
        if found is None:
            scope = common_pb2.Scope(
                tenant=tenant,
                model=info.name,
                model_version=info.version,
                parameters=answer_parameters(top_k, info.digest),
            )
            found = (scope, scope_tuple(scope))
            _bounded_put(self._scopes, memo, found, self.capacity)
        return found


class _KeyMemo:
    """Exact keys of recent (scope, text) pairs: a repeat, the local tier's whole business,
    skips the scope's canonical JSON and the SHA-256 (a quarter of its gateway time)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[tuple[ScopeTuple, str], str] = OrderedDict()

    def get(self, scope: ScopeTuple, text: str) -> str:
        memo = (scope, text)
        key = self._keys.get(memo)
        if key is None:
            normalised = normalise_text(text)
            if not normalised:  # the model would read [CLS] [SEP] alone: nothing of the text
                raise unreadable("text")
            key = normalised_key(scope, normalised)
            _bounded_put(self._keys, memo, key, self.capacity)
        return key


def unreadable(where: str) -> RequestError:
    """The refusal of a text with nothing the model reads, `where` naming it."""
    return RequestError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{where} has no character the model reads (only control, zero-width, combining, "
        "private-use or replacement characters): send the text to classify",
    )


def _bounded_put(memo: OrderedDict[Any, Any], key: Any, value: Any, capacity: int) -> None:
    # An OrderedDict finds its oldest entry through its own links. A plain dict's first key is
    # found by walking every slot deleted before it, and at the key memo's bound every miss
    # deleted one: 7 us a put in a loop, against 0.35 (docs/performance.md, stop 88).
    if len(memo) >= capacity:
        memo.popitem(last=False)
    memo[key] = value


_SCOPES = _Scopes(capacity=4_096)
_KEYS = _KeyMemo(capacity=16_384)
_CACHE_MODE_NUMBERS = frozenset(common_pb2.CacheMode.values())


def check_cache_mode(mode: int, where: str = "PredictRequest.cache_mode") -> None:
    """INVALID_ARGUMENT for a number outside the CacheMode enum (open in proto3)."""
    if mode not in _CACHE_MODE_NUMBERS:
        names = ", ".join(f"{name} ({number})" for number, name in CACHE_MODES)
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{where} {mode} is not a CacheMode: use {names}"
        )


@dataclasses.dataclass
class PredictCall:
    """One text through cache and hops (see the module docstring)."""

    text: str
    info: inference_pb2.ModelInfo
    top_k: int
    mode: common_pb2.CacheMode.ValueType  # the request's; UNSPECIFIED is read as USE
    timeout_s: float  # the request's budget when it came in: its deadline, or the gateway's cap
    started: float  # perf_counter when the RPC began, for the `total` timing and the deadline
    # Every parameter that changes the answer is part of the scope, hence of every key.
    scope: common_pb2.Scope  # shared between requests (_Scopes): never written
    scope_key: ScopeTuple  # scope_tuple(scope)
    key: str  # the cache's exact key, also the local tier's and the coalescer's
    response: gateway_pb2.PredictResponse
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    tokenizing: asyncio.Future[tokenizer_pb2.TokenizeResponse] | None = None
    local: bool = False  # the gateway's local exact tier answered
    known_miss: bool = False  # the key mirror vouched for the miss: no lookup was sent
    speculative: bool = False  # inference started beside the cache lookup
    fail_open_reason: str = ""  # the upstream status, or circuit_open
    verify_id: str = ""  # the cache wants the model's answer for this text (verified hits)
    # The lookup's query embedding, when the model's head takes the cache's encoder's vectors.
    embedding: common_pb2.Tensor | None = None
    # Stages whose answer came from other files than the scope's digest names (a version's
    # files changing under the services, each reloading on its own): not cached.
    files_differ: dict[str, str] = dataclasses.field(default_factory=dict)
    deadline: float = dataclasses.field(init=False)  # perf_counter

    def __post_init__(self) -> None:
        self.deadline = self.started + self.timeout_s

    def left_s(self) -> float:
        """What the budget leaves now: each hop gets this, not the whole budget. Without a
        client deadline nothing else ends the request (three hops given the whole
        HOPLINE_UPSTREAM_TIMEOUT_S each took up to three times it)."""
        return self.deadline - time.perf_counter()

    def renew(self, budget_s: float) -> None:
        """A new budget from now, for work after the reply (a served hit's verification),
        which the caller's deadline no longer bounds."""
        self.deadline = time.perf_counter() + budget_s

    @classmethod
    def new(
        cls,
        text: str,
        info: inference_pb2.ModelInfo,
        tenant: str,
        top_k: int,
        cache_mode: common_pb2.CacheMode.ValueType,
        timeout_s: float,
        started: float,
    ) -> PredictCall:
        scope, scope_key = _SCOPES.get(tenant, info, top_k)
        response = gateway_pb2.PredictResponse(
            model=info.name,
            model_version=info.version,
            model_digest=info.digest,
            tenant=tenant,
            trace_id=current_trace_id(),
        )
        mode = cache_mode or common_pb2.CACHE_MODE_USE
        key = _KEYS.get(scope_key, text)
        return cls(text, info, top_k, mode, timeout_s, started, scope, scope_key, key, response)

    @property
    def cache(self) -> gateway_pb2.CacheInfo:
        return self.response.cache

    @property
    def use_cache(self) -> bool:
        """Whether to read the cache: the model caches and the request did not opt out."""
        return self.info.cache.mode != "off" and self.mode == common_pb2.CACHE_MODE_USE

    @property
    def wants_store(self) -> bool:
        """Whether the request's inference is to be written back: REFRESH stores, BYPASS
        does not, nor does a model whose cache is off."""
        return self.info.cache.mode != "off" and self.mode != common_pb2.CACHE_MODE_BYPASS

    @property
    def may_store(self) -> bool:
        """wants_store, unless some stage computed the answer from other files than the
        scope's."""
        return self.wants_store and not self.files_differ

    def drop_tokens(self) -> None:
        if self.tokenizing is not None:
            discard(self.tokenizing)


def discard(task: asyncio.Future[Any]) -> None:
    """Cancel work whose answer is no longer needed, without an unretrieved-error warning."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
