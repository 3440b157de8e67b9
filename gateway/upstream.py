"""Pools of channels to one upstream service, and hop calls that name the hop on failure.

gRPC shares one TCP connection between channels whose arguments are identical, so each
channel of a pool gets its own index argument and a local subchannel pool: N channels are
N connections, and concurrent calls are not serialised behind one HTTP/2 connection.

GatewayUpstreams holds the four pools the gateway calls. GatewayService builds them from its
config unless it is given them, which is how tests/unit runs the orchestration in-process.

Retries across replicas are gRPC's own (`retry_service_config`): a failed attempt is tried
again on the channel's next round-robin pick, within the call's one deadline, and a retry
budget (`retryThrottling`) stops retries when many attempts fail, so they cannot multiply an
overload. See `retry_service_config` for which methods and which statuses, and why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from hopline.gateway.addresses import REPLICAS_RESOLVE_S, replica_targets, resolve_replicas
from hopline.gateway.config import MAX_ATTEMPTS_CAP, MAX_RETRY_TOKENS
from hopline.gateway.resilience import with_ejection
from hopline.observability import metrics, schema
from hopline.observability.logs import Episodes
from hopline.observability.tracing import child_span, outgoing_metadata
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.errors import StatusError
from hopline.runtime.inproc import INPROC, DirectCall, InProcessService
from hopline.runtime.service_table import ServiceName, spec
from hopline.runtime.tls import ClientCertificates, ClientTls, TlsFiles, aio_channel

if TYPE_CHECKING:
    from hopline.gateway.config import GatewayConfig

log = logging.getLogger("hopline.gateway.upstream")
# The gRPC service each upstream serves, as its server registers it with its health service.
SERVICE_NAMES = {
    ServiceName.TOKENIZER: tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name,
    ServiceName.CACHE: cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name,
    ServiceName.INFERENCE: inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    ServiceName.POSTPROCESS: postprocess_pb2.DESCRIPTOR.services_by_name[
        "PostprocessService"
    ].full_name,
}
# An upstream's own failures (UNAVAILABLE, INTERNAL) by hop and target: every request fails
# while it is down, so they are logged once an episode (observability/logs.py:Episodes).
HOP_FAILURES = Episodes(log, "hop failed")

StubT = TypeVar("StubT")
StubT_co = TypeVar("StubT_co", covariant=True)


class HopError(StatusError):
    """An upstream call failed; carries the status the gateway should return.

    `.message` is for the caller: it names the hop, never the address it dials (that, and
    the upstream's own details, go to the log and the hop's span: `.target`, `.details`).
    """

    def __init__(
        self, hop: str, code: grpc.StatusCode, message: str, target: str = "", details: str = ""
    ) -> None:
        super().__init__(code, message)
        self.hop = hop
        self.target = target
        self.details = details


# The gateway's upstream methods that gRPC may try again, by service. Every one is safe to
# repeat, because none changes anything a second run would change again:
# - Tokenize, Infer, Postprocess: pure functions of the request and the model version named
#   in it (immutable folders), so a second run answers the same and leaves nothing behind.
# - Lookup, GetStats, ListModels: reads.
# - Store, StoreBatch: write each entry under its exact key; a repeat writes the same entry
#   over itself.
# - Invalidate: deleting what is already deleted deletes nothing more.
# - ReportVerification: an UNAVAILABLE or CANCELLED attempt never reached (or never finished
#   in) a servicer, so the verify_id was not taken; any replica takes it (it carries the
#   comparison: cache/verify_ids.py).
# - AckInvalidations: confirming a sequence already confirmed changes nothing.
# WatchInvalidations is left out: a long-lived stream the local exact tier re-opens itself
# (gateway/exact_tier.py), and gRPC could not retry it after its first message anyway.
RETRY_METHODS: dict[str, tuple[str, ...]] = {
    "hopline.tokenizer.v1.TokenizerService": ("Tokenize",),
    "hopline.cache.v1.CacheService": (
        "Lookup",
        "Store",
        "StoreBatch",
        "Invalidate",
        "GetStats",
        "ReportVerification",
        "AckInvalidations",
    ),
    "hopline.inference.v1.InferenceService": ("Infer", "ListModels"),
    "hopline.postprocess.v1.PostprocessService": ("Postprocess",),
}
# UNAVAILABLE: the attempt never reached a servicer that could answer (connection refused or
# reset by a killed replica, a replica still starting or draining). CANCELLED from the upstream
# (never our own cancel, which ends the call at once and is not retried): gRPC core ends the
# calls a stopping server had accepted but not yet handed to a handler with CANCELLED, not
# UNAVAILABLE (grpc/grpc#41785, open), so a replica drained under load hands a few callers a
# CANCELLED for work it never started. Not DEADLINE_EXCEEDED:
# the deadline is the call's, shared by every attempt, so once it has passed there is no time
# left to retry in, and the cache lookup's short budget must stay the bound it is. Not
# RESOURCE_EXHAUSTED: that is an upstream shedding load (a full batch queue) or a message too
# large, and a retry would add load to an overload or fail again the same way.
RETRYABLE_CODES = ("UNAVAILABLE", "CANCELLED")


def _seconds(ms: float) -> str:
    """A protobuf Duration in JSON form, as the service config wants it."""
    return f"{max(ms, 1.0) / 1000:.3f}s"


def retry_service_config(
    attempts: int,
    initial_backoff_ms: float,
    max_backoff_ms: float,
    budget_tokens: int,
    token_ratio: float,
) -> dict[str, Any] | None:
    """The gRPC service config for one upstream's channels; None when retries are off.

    `attempts` counts the first try (0 or 1: no retries). gRPC spreads the attempts over the
    channel's round-robin picks, so a retry lands on another replica while one fails; all of
    them share the call's own deadline. `retryThrottling` is the retry budget: each failed
    attempt takes a token from `budget_tokens`, each success gives back `token_ratio`, and
    retries stop while fewer than half remain, so at most about one retry per 1/token_ratio
    successes survives a lasting failure of every replica.
    """
    if attempts <= 1:
        return None
    names = [
        {"service": service, "method": method}
        for service, methods in RETRY_METHODS.items()
        for method in methods
    ]
    return {
        "methodConfig": [
            {
                "name": names,
                "retryPolicy": {
                    "maxAttempts": min(attempts, MAX_ATTEMPTS_CAP),
                    "initialBackoff": _seconds(initial_backoff_ms),
                    "maxBackoff": _seconds(max(max_backoff_ms, initial_backoff_ms)),
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": list(RETRYABLE_CODES),
                },
            }
        ],
        # gRPC accepts an integer maxTokens in (0, MAX_RETRY_TOKENS] (a float fails the
        # channel) and a tokenRatio above 0 (3 decimals).
        "retryThrottling": {
            "maxTokens": min(max(int(budget_tokens), 1), MAX_RETRY_TOKENS),
            "tokenRatio": max(round(token_ratio, 3), 0.001),
        },
    }


def retry_budget(config: GatewayConfig) -> int:
    """The retry budget's tokens: HOPLINE_UPSTREAM_RETRY_TOKENS, or, at its default 0, enough
    for every call the gateway may have in flight to fail at once and still be retried.

    A replica that dies fails every call it holds in one moment, and each failure spends a
    token: a budget smaller than twice that backlog stops retrying part of it, and those calls
    reach clients as UNAVAILABLE though the other replica is up. Killing one of two tokenizer
    replicas holding 32 of 64 calls failed 24 of them with the former fixed budget of 20
    tokens, none with this one (tests/mesh/test_replicas.py). The budget still ends retries
    when every replica keeps failing: past the backlog, one retry per 1/token_ratio successes.
    """
    if config.upstream_retry_tokens:
        return config.upstream_retry_tokens
    if not config.max_in_flight:
        return MAX_RETRY_TOKENS
    return min(2 * config.max_in_flight, MAX_RETRY_TOKENS)


def config_retry_policy(config: GatewayConfig) -> dict[str, Any] | None:
    """`retry_service_config` with the gateway config's HOPLINE_UPSTREAM_RETRY_* values."""
    return retry_service_config(
        config.upstream_retry_attempts,
        config.upstream_retry_backoff_ms,
        config.upstream_retry_max_backoff_ms,
        retry_budget(config),
        config.upstream_retry_token_ratio,
    )


# gRPC's client-side health checking: a replica is in a channel's round-robin picks only while
# its health service says SERVING. Without it a replica is picked as soon as its port accepts
# connections: a new one still loading its models (it binds first so probes see NOT_SERVING,
# and answers UNAVAILABLE "starting up") and a draining one in its NOT_SERVING delay took
# calls, spent the retry budget, and a burst of those failures got a replica that was about to
# be ready ejected (gateway/resilience.py) for longer than a rollout waits before replacing
# the other one, which then left a channel with no replica at all. Replacing one of two
# inference replicas 12 times under 4 closed-loop callers (bench/scripts/replica_replacement.py):
# 331 of 9624 requests failed without it, 0 of 9038 with it.
HEALTH_CHECKED: dict[str, Any] = {"healthCheckConfig": {"serviceName": ""}}
# A health-checked channel's state when no replica says SERVING (or none is reachable).
NO_REPLICA_SERVING = grpc.ChannelConnectivity.TRANSIENT_FAILURE


def upstream_service_config(config: GatewayConfig) -> dict[str, Any]:
    """An upstream channel's service config: health-checked picks, retries and ejection."""
    return {**(with_ejection(config_retry_policy(config), config) or {}), **HEALTH_CHECKED}


# The longest a channel waits between attempts to reach a replica that went away (gRPC adds up
# to 20% jitter). A replica back on the same address is in every channel's picks only after
# this, so a rollout keeps the next replica up that long after the new one is ready
# (minReadySeconds in deploy/k8s; tests/mesh/test_rolling_replacement.py).
MAX_RECONNECT_BACKOFF_MS = 2_000
RECONNECT_JITTER = 0.2


KEEPALIVE_TIMEOUT_MS = 5_000


def channel_options(
    index: int, max_message_bytes: int, service_config: dict[str, Any] | None = None
) -> list[tuple[str, Any]]:
    # Without a service config the channel keeps gRPC's defaults: transparent retries only
    # (an attempt that never left this process). The gateway's own channels always have one
    # (upstream_service_config: health checking at least).
    retries: list[tuple[str, Any]] = (
        [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(service_config))]
        if service_config
        else []
    )
    return [
        *retries,
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.use_local_subchannel_pool", 1),
        ("hopline.channel_index", index),
        # A ping every 10 s (the services take one every 5 s): a hung replica's connection,
        # and every call sent on it meanwhile, is dropped within 15 s of its last answer.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # The ping's own timeout, which gRPC core (1.85) applies to keepalive pings in place
        # of the one above: 60 s by default, so a hung replica (a stopped process, a frozen
        # node) held its connection, and the calls sent on it, for about 80 s.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Fail fast while a peer restarts instead of backing off for up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


class Upstream(Generic[StubT]):
    """`size` channels to one service, used in turn. With TLS, they are dialled again once
    the certificate files change (runtime/tls.py:ClientCertificates); the old channels'
    calls get `redial_grace_s` to finish before those channels close.

    With health-checked picks (HEALTH_CHECKED), one more channel without them is the last
    resort: a call finding no replica SERVING goes by it to any that accepts. A replica that
    drains says NOT_SERVING at once and answers for its drain delay more (HOPLINE_DRAIN_DELAY_S)
    so that callers with another replica move away; a caller with none failed at once instead
    of being answered (an operator's probe: a graceful SIGTERM of the one cache replica failed
    the gateway's stores of the 0.35 s before it stopped accepting, and a mesh deleted whole,
    the order Kubernetes keeps, failed 29 requests its services would still have answered)."""

    def __init__(
        self,
        hop: str,
        target: str,
        stub: Callable[[grpc.aio.Channel], StubT],
        size: int,
        max_message_bytes: int,
        service_config: dict[str, Any] | None = None,
        certificates: ClientCertificates | None = None,
        redial_grace_s: float = 30.0,
        serves: tuple[str, str] | None = None,
    ) -> None:
        self.hop = hop
        self.target = target
        self._serves = serves  # (the gRPC service it must serve, the setting that names it)
        self._checking: asyncio.Task[None] | None = None
        self._make_stub = stub
        self._options = [
            channel_options(i, max_message_bytes, service_config) for i in range(max(1, size))
        ]
        unchecked = {k: v for k, v in (service_config or {}).items() if k not in HEALTH_CHECKED}
        self._last_resort_options = (
            channel_options(0, max_message_bytes, unchecked)
            if service_config and unchecked != service_config
            else None
        )
        # A replica said SERVING once: before that (the services still loading as the gateway
        # starts) the last resort would reach only a replica answering "starting up", and
        # held a connection more than the pool's for nothing (a fresh clone's test_transport).
        self._served = False
        self._certificates = certificates
        self._redial_grace_s = redial_grace_s
        self._closing: set[asyncio.Task[None]] = set()
        # One channel per replica, for hedges (`replica_stubs`): made on first use.
        self._replicas: dict[str, tuple[grpc.aio.Channel, StubT]] = {}
        self._replica_targets: list[str] | None = replica_targets(target)
        self._resolved: list[str] = []  # what a host name resolved to last
        self._resolved_at = -math.inf
        self._resolving: asyncio.Task[None] | None = None
        self._dial(certificates.current if certificates is not None else None)

    def _dial(self, tls: ClientTls | None) -> None:
        self._tls = tls
        self.channels = [aio_channel(self.target, tls, options) for options in self._options]
        self._next = itertools.cycle([(c, self._make_stub(c)) for c in self.channels])
        self._last_resort: tuple[grpc.aio.Channel, StubT] | None = None
        if self._last_resort_options is not None:
            channel = aio_channel(self.target, tls, self._last_resort_options)
            self._last_resort = (channel, self._make_stub(channel))
        old, self._replicas = self._replicas, {}
        self._close_later([channel for channel, _ in old.values()])

    def replica_count(self) -> int:
        """How many servers the target names now: 1 for one address, or a host name not yet
        resolved (resolved every REPLICAS_RESOLVE_S, in the background)."""
        if self._replica_targets is not None:
            return max(1, len(self._replica_targets))
        self._resolve_later()
        return max(1, len(self._resolved))

    def replica_stubs(self) -> list[tuple[str, StubT]]:
        """A stub per replica, each on its own channel to that one address, keyed by it: a
        hedge must reach another replica than the attempt it backs up, and round_robin's next
        pick, with other callers' picks between, was the hung one again about half the time
        (with two replicas and seven callers, every caller waited 5 s for the connection to
        drop in two runs of four: a helper's probe). Empty until a host name is resolved
        (every REPLICAS_RESOLVE_S, in the background)."""
        self._redial_if_renewed()
        targets = self._replica_targets
        if targets is None:  # a host name: what it resolves to now
            self._resolve_later()
            targets = self._resolved
        if len(self._replicas) != len(targets) or any(t not in self._replicas for t in targets):
            self._replicas = self._replica_channels(targets)
        return [(t, stub) for t, (_, stub) in self._replicas.items()]

    def _replica_channels(self, targets: list[str]) -> dict[str, tuple[grpc.aio.Channel, StubT]]:
        kept = {t: self._replicas[t] for t in targets if t in self._replicas}
        gone = [channel for t, (channel, _) in self._replicas.items() if t not in kept]
        self._close_later(gone)
        for t in targets:
            if t not in kept:
                channel = aio_channel(t, self._tls, self._options[0])
                kept[t] = (channel, self._make_stub(channel))
        return kept

    def _resolve_later(self) -> None:
        now = time.monotonic()
        if self._resolving is not None or now - self._resolved_at < REPLICAS_RESOLVE_S:
            return
        self._resolved_at = now
        self._resolving = asyncio.ensure_future(self._resolve())

    async def _resolve(self) -> None:
        try:
            self._resolved = await resolve_replicas(self.target)
        except OSError as exc:  # said by the main channel's own failures: keep the last list
            log.debug("resolving replicas failed", extra={"target": self.target, "error": str(exc)})
        finally:
            self._resolving = None

    def _close_later(self, channels: list[grpc.aio.Channel]) -> None:
        for channel in channels:
            task = asyncio.ensure_future(channel.close(grace=self._redial_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def stub(self) -> StubT:
        self._redial_if_renewed()
        channel, stub = next(self._next)
        state = channel.get_state()
        if state == NO_REPLICA_SERVING:
            if self._last_resort is not None and self._served:
                return self._last_resort[1]  # every replica NOT_SERVING or away: any that accepts
        elif not self._served and state == grpc.ChannelConnectivity.READY:
            self._served = True
        return stub

    def none_serving(self) -> bool:
        """Whether the health-checked picks, which had a replica SERVING, have none now
        (draining, restarting, or away): what is sent now goes by the last resort."""
        return (
            self._last_resort is not None
            and self._served
            and self.channels[0].get_state() == NO_REPLICA_SERVING
        )

    def _redial_if_renewed(self) -> None:
        if self._certificates is not None and (renewed := self._certificates.renewed()):
            self._redial(renewed)

    def _redial(self, tls: ClientTls) -> None:
        log.info("TLS files changed; dialling again with them", extra={"target": self.target})
        old = self._all_channels()
        self._dial(tls)
        self._close_later(old)

    def _all_channels(self) -> list[grpc.aio.Channel]:
        last = [self._last_resort[0]] if self._last_resort is not None else []
        return [*self.channels, *last]

    def connected(self, try_to_connect: bool = True) -> bool:
        """Whether a channel has a ready connection (with health checking: to a replica that
        says SERVING). `try_to_connect` wakes an idle channel, which connects only when asked."""
        ready = grpc.ChannelConnectivity.READY
        return any(c.get_state(try_to_connect) == ready for c in self.channels)

    def check_serves(self) -> None:
        """Ask in the background whether the address serves the service it must: one that
        serves another (an address setting naming the wrong service) would leave the gateway
        SERVING and every call of this hop failing UNIMPLEMENTED, so it is said once."""
        if self._serves is not None and self._checking is None:
            self._checking = asyncio.ensure_future(self._check_serves(*self._serves))

    async def _check_serves(self, service: str, setting: str) -> None:
        # hopline's servers register each service's name with their health service.
        delay_s = 0.5
        while True:
            # The channel in use now: renewed TLS files replace the channels, closing the old.
            stub = health_pb2_grpc.HealthStub(self.channels[0])
            try:
                await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                return  # SERVING or NOT_SERVING: the service is there
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        f"{setting} answers but does not serve {service}: does it name "
                        "another service? Every call of this hop will fail",
                        extra={"hop": self.hop, "target": self.target},
                    )
                    return
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # no health service to ask: not one of hopline's, nothing to say
            await asyncio.sleep(delay_s)  # not up yet, or unreachable: ask again
            delay_s = min(2 * delay_s, 10.0)

    async def close(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
        if self._resolving is not None:
            self._resolving.cancel()
        for channel in [*self._all_channels(), *(c for c, _ in self._replicas.values())]:
            await channel.close(grace=None)
        for task in list(self._closing):
            task.cancel()


class CoLocated(Generic[StubT]):
    """A service running in this process (address `inproc`), called through its own stub."""

    def __init__(self, service: InProcessService, stub: Callable[[Any], StubT]) -> None:
        self.service = service
        self._stub = stub(service.channel)

    @property
    def target(self) -> str:
        return INPROC

    def stub(self) -> StubT:
        return self._stub

    def direct(self, rpc: str) -> DirectCall | None:
        """The method `rpc` with no layers between the gateway and the servicer, for calls
        whose trace is not recorded (runtime/inproc.py:DirectCall)."""
        return self.service.direct(rpc)

    async def start(self) -> None:
        await self.service.start()

    async def close(self) -> None:
        await self.service.stop()


class Pool(Protocol[StubT_co]):
    """What the gateway needs of an upstream: Upstream is the real one, tests use stand-ins."""

    @property
    def target(self) -> str:
        """The address it dials, for error messages and spans."""

    def stub(self) -> StubT_co:
        """A stub for the next call."""

    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class GatewayUpstreams:
    """The four services the gateway calls.

    GatewayService connects to the addresses in its config unless it is handed these, so the
    orchestration can run in-process against stand-ins.
    """

    tokenizer: Pool[tokenizer_pb2_grpc.TokenizerServiceAsyncStub]
    cache: Pool[cache_pb2_grpc.CacheServiceAsyncStub]
    inference: Pool[inference_pb2_grpc.InferenceServiceAsyncStub]
    postprocess: Pool[postprocess_pb2_grpc.PostprocessServiceAsyncStub]

    @classmethod
    def connect(cls, config: GatewayConfig) -> GatewayUpstreams:
        """Pools to the addresses in `config`; an address of `inproc` co-locates the service."""

        def pool(
            name: ServiceName, hop: str, addr: str, stub: Callable[[Any], StubT]
        ) -> Pool[StubT]:
            if addr == INPROC:
                return CoLocated(InProcessService.load(spec(name)), stub)
            return Upstream(
                hop,
                addr,
                stub,
                config.channels_per_upstream,
                config.max_message_bytes,
                upstream_service_config(config),
                ClientCertificates(TlsFiles.of(config, ServiceName.GATEWAY), name),
                config.upstream_timeout_s,
                serves=(SERVICE_NAMES[name], spec(name).addr_env),
            )

        return cls(
            tokenizer=pool(
                ServiceName.TOKENIZER,
                schema.SPAN_TOKENIZE,
                config.tokenizer_addr,
                tokenizer_pb2_grpc.TokenizerServiceStub,
            ),
            cache=pool(
                ServiceName.CACHE,
                schema.SPAN_CACHE_LOOKUP,
                config.cache_addr,
                cache_pb2_grpc.CacheServiceStub,
            ),
            inference=pool(
                ServiceName.INFERENCE,
                schema.SPAN_INFERENCE,
                config.inference_addr,
                inference_pb2_grpc.InferenceServiceStub,
            ),
            postprocess=pool(
                ServiceName.POSTPROCESS,
                schema.SPAN_POSTPROCESS,
                config.postprocess_addr,
                postprocess_pb2_grpc.PostprocessServiceStub,
            ),
        )

    @property
    def pools(self) -> tuple[Pool[Any], ...]:
        return (self.tokenizer, self.cache, self.inference, self.postprocess)

    def co_located(self) -> set[ServiceName]:
        """The services running in this process."""
        return {
            ServiceName(field.name)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), CoLocated)
        }

    async def start(self) -> None:
        """Start the co-located services (the gateway serves only once they do), and check
        in the background that each remote address serves its service."""
        for remote in self.pools:
            if isinstance(remote, Upstream):
                remote.check_serves()
        await asyncio.gather(*(p.start() for p in self.pools if isinstance(p, CoLocated)))

    async def close(self) -> None:
        for upstream in self.pools:
            await upstream.close()


# Addresses grpc core writes into its details ("ipv4:127.0.0.1:8011: Connection refused").
_ADDRESS = re.compile(
    r"\b(?:ipv4|ipv6|unix|unix-abstract|dns|vsock):[^\s,;]+"
    r"|\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?"
)
DETAILS_CHARS = 300  # an upstream's details passed on to the caller, at most


def caller_details(details: str, target: str) -> str:
    """An upstream's status details fit for the caller: no address in them, and short."""
    text = details.replace(target, "<address>") if target else details
    text = _ADDRESS.sub("<address>", text)
    return text if len(text) <= DETAILS_CHARS else text[: DETAILS_CHARS - 1] + "\u2026"


def _hop_error(hop: str, target: str, err: grpc.aio.AioRpcError) -> HopError:
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        # grpc's details here are about the connection (and name the address): logged, not
        # returned. The caller can only retry.
        return HopError(hop, code, f"{hop} service unavailable", target, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HopError(
            hop, code, f"deadline exceeded waiting for the {hop} service", target, details
        )
    if code == grpc.StatusCode.CANCELLED:
        # The upstream ended the call: our own cancel raises CancelledError, not this. It is a
        # replica going away (see RETRYABLE_CODES), so the caller hears it as what it is.
        return HopError(
            hop,
            grpc.StatusCode.UNAVAILABLE,
            f"{hop} service unavailable (it ended the call while shutting down)",
            target,
            details,
        )
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        # The upstream refused the gateway itself (its certificate, its peers list): the
        # operator's to mend. Its message names internal certificates and who is served, and
        # tells a caller to call through the gateway: logged, not returned.
        return HopError(
            hop,
            grpc.StatusCode.INTERNAL,
            f"{hop} failed: the {hop} service refused the gateway ({code.name}; the gateway's "
            "log says why)",
            target,
            details,
        )
    shown = caller_details(details, target)
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ):
        return HopError(hop, code, f"{hop}: {shown}", target, details)
    return HopError(
        hop, grpc.StatusCode.INTERNAL, f"{hop} failed with {code.name}: {shown}", target, details
    )


def hop_failure(hop: str, target: str, err: grpc.aio.AioRpcError) -> HopError:
    """The HopError a failed call of `hop` becomes; the upstream's own failures logged, once
    an episode (`HOP_FAILURES`)."""
    failure = _hop_error(hop, target, err)
    if failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
        status = err.code().name
        HOP_FAILURES.failed(
            (hop, target), status, hop=hop, target=target, status=status, details=failure.details
        )
    return failure


async def call_hop(
    hop: str,
    target: str,
    rpc: Callable[..., Awaitable[Any]],
    request: Any,
    timeout_s: float,
    timings: dict[str, float],
) -> Any:
    """One traced upstream call; records its wall time and maps failures to HopError."""
    started = time.perf_counter()
    with child_span(
        hop,
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "server.address": target, schema.HOP: hop},
        quiet=True,
    ) as span:
        code = grpc.StatusCode.OK
        try:
            if timeout_s <= 0:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                said = f"deadline exceeded before calling the {hop} service"
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {said}"))
                raise HopError(hop, code, said, target)
            reply = await rpc(request, timeout=timeout_s, metadata=outgoing_metadata())
            HOP_FAILURES.ended((hop, target))
            return reply
        except grpc.aio.AioRpcError as err:
            code = err.code()
            failure = hop_failure(hop, target, err)
            # The span has the address (server.address) and the upstream's own details.
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {failure.details}"))
            raise failure from None
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            span.set_status(Status(StatusCode.ERROR, "CANCELLED: the request gave up the call"))
            raise
        finally:
            elapsed = time.perf_counter() - started
            timings[hop] = elapsed * 1e3
            metrics.hop_duration(hop, code.name).observe(elapsed, metrics.trace_exemplar())
