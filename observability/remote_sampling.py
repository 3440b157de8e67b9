"""Jaeger remote sampling: which traces to keep, changed while the mesh runs.

An engineer chasing a tail raises the gateway's sampling in Jaeger's strategies file (a
ConfigMap in Kubernetes) and every gateway process follows within its polling interval, with
no restart, and drops back as quickly once the slow requests are caught. The OpenTelemetry
spec names this sampler and its settings; the Python SDK does not ship one, so this is ours:

    OTEL_TRACES_SAMPLER=parentbased_jaeger_remote     (jaeger_remote: ignore the caller's flag)
    OTEL_TRACES_SAMPLER_ARG=endpoint=http://jaeger:5778,pollingIntervalMs=5000,initialSamplingRate=0.1

`endpoint` is Jaeger's sampling endpoint over HTTP (Jaeger v2's `remote_sampling` extension,
`http` on port 5778; hopline does not speak its gRPC form on 5779). Each process asks for its
service name's strategy (OTEL_SERVICE_NAME, else hopline's: gateway, cache, ...) and applies
it as Jaeger's own clients do: probabilistic (a share of traces, by trace id), rate limiting
(at most N traces a second), or per operation (a share per root span name, such as
`hopline.gateway.v1.GatewayService/Predict`, each with at least the lower bound's traces a
second). Until Jaeger first answers, and whenever it cannot be reached or serves something
unreadable, the last strategy holds (initialSamplingRate at first; when unset, hopline's
export default, 10%); a failure is logged once per outage. Only a trace's
root decides (the gateway, for a client that sends no `traceparent`); in the parent-based
form every other process follows it, so a trace stays whole.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import http.client
import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

from hopline.observability import metrics

log = logging.getLogger("hopline.tracing.remote_sampling")

SAMPLER_NAMES = ("jaeger_remote", "parentbased_jaeger_remote")
DEFAULT_ENDPOINT = "http://localhost:5778"
DEFAULT_POLL_S = 60.0  # as OpenTelemetry's Java and JavaScript remote samplers
FETCH_TIMEOUT_S = 5.0
PROBABILISTIC, RATE_LIMITING = 0, 1  # Jaeger's SamplingStrategyType, as its JSON numbers it
# What a sampled root span says about why it was kept (the attributes Jaeger's clients set).
SAMPLER_TYPE, SAMPLER_PARAM = "sampler.type", "sampler.param"


class Kept(enum.StrEnum):
    """Why a root was kept: `sampler.type`'s values in Jaeger's clients."""

    PROBABILISTIC = "probabilistic"
    RATE_LIMITING = "ratelimiting"
    LOWER_BOUND = "lowerbound"


@dataclasses.dataclass(frozen=True)
class RemoteSettings:
    initial_rate: float  # the caller's default share (tracing.EXPORT_SAMPLE_RATIO): no second copy
    endpoint: str = DEFAULT_ENDPOINT
    poll_s: float = DEFAULT_POLL_S

    @classmethod
    def parse(cls, arg: str, initial_rate: float) -> RemoteSettings:
        """OTEL_TRACES_SAMPLER_ARG's `key=value,...` form; ValueError names what is wrong."""
        given: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in arg.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in (
                "endpoint",
                "pollingIntervalMs",
                "initialSamplingRate",
            ):
                raise ValueError(
                    f"OTEL_TRACES_SAMPLER_ARG: {part!r} is not endpoint=, pollingIntervalMs= "
                    "or initialSamplingRate="
                )
            given[key.strip()] = value.strip()
        endpoint = given.get("endpoint", DEFAULT_ENDPOINT).rstrip("/")
        if urllib.parse.urlsplit(endpoint).scheme not in ("http", "https"):
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG: endpoint {endpoint!r} is not an http URL")
        try:
            poll_s = float(given.get("pollingIntervalMs", DEFAULT_POLL_S * 1000)) / 1000
            rate = float(given.get("initialSamplingRate", initial_rate))
        except ValueError as exc:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG: {exc}") from None
        if not poll_s > 0:
            raise ValueError("OTEL_TRACES_SAMPLER_ARG: pollingIntervalMs must be above 0")
        _check_rate(rate, "initialSamplingRate")
        return cls(rate, endpoint, poll_s)


def _check_rate(rate: float, what: str) -> float:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{what} must be 0 to 1, got {rate}")
    return rate


# Trace ids whose decision a process remembers (a trace's spans in one process start within
# its request: far fewer traces than this start meanwhile).
DECIDED_TRACES = 4096


def _follow(sampled: bool, parent: trace.SpanContext) -> SamplingResult:
    """A span of a trace decided before: as its root was, without the root's attributes."""
    decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP
    return SamplingResult(decision, None, parent.trace_state)


def _result(sampled: bool, parent: Context | None, kind: Kept, param: float) -> SamplingResult:
    trace_state = trace.get_current_span(parent).get_span_context().trace_state
    if not sampled:
        return SamplingResult(Decision.DROP, None, trace_state)
    attributes = {SAMPLER_TYPE: kind.value, SAMPLER_PARAM: param}
    return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)


class RateLimiter:
    """Jaeger's leaky bucket: `per_second` credits a second, holding at most max(1, rate)."""

    def __init__(self, per_second: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second = per_second
        self.max_balance = max(per_second, 1.0)
        self.balance = self.max_balance
        self.clock = clock
        self.last = clock()
        self.lock = threading.Lock()  # roots start on the event loop and on worker threads

    def take(self) -> bool:
        with self.lock:
            now = self.clock()
            self.balance = min(self.max_balance, self.balance + (now - self.last) * self.per_second)
            self.last = now
            if self.balance >= 1.0:
                self.balance -= 1.0
                return True
            return False


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one operation (or every operation without its own rule) is sampled."""

    rate: float = 0.0  # share of traces kept by trace id
    per_second: float = 0.0  # rate limiting: at most this many; with a rate: at least this many

    def sampler(self, clock: Callable[[], float]) -> RuleSampler:
        return RuleSampler(self, clock)


class RuleSampler:
    def __init__(self, rule: Rule, clock: Callable[[], float]) -> None:
        self.rule = rule
        # The share by trace id exactly as the SDK's TraceIdRatioBased draws it.
        self.bound = TraceIdRatioBased.get_bound_for_rate(rule.rate)
        self.limiter = RateLimiter(rule.per_second, clock) if rule.per_second > 0 else None

    def decide(self, parent: Context | None, trace_id: int) -> SamplingResult:
        if self.rule.rate == 0.0 and self.limiter is not None:  # rate limiting alone
            return _result(self.limiter.take(), parent, Kept.RATE_LIMITING, self.rule.per_second)
        by_id = trace_id & TraceIdRatioBased.TRACE_ID_LIMIT < self.bound
        # Jaeger's guaranteed throughput: a kept trace spends a credit too, so the lower
        # bound adds traces only when the share alone keeps too few.
        floor = self.limiter is not None and self.limiter.take()
        if by_id:
            return _result(True, parent, Kept.PROBABILISTIC, self.rule.rate)
        return _result(floor, parent, Kept.LOWER_BOUND, self.rule.rate)


@dataclasses.dataclass(frozen=True)
class Strategy:
    default: Rule
    operations: Mapping[str, Rule] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        def one(rule: Rule) -> str:
            if rule.rate == 0.0 and rule.per_second > 0:
                return f"at most {rule.per_second:g} traces/s"
            floor = f", at least {rule.per_second:g}/s" if rule.per_second > 0 else ""
            return f"{rule.rate:g} of traces{floor}"

        ops = "".join(f"; {name}: {one(r)}" for name, r in sorted(self.operations.items()))
        return one(self.default) + ops


def parse_strategy(doc: Any) -> Strategy:
    """Jaeger's sampling strategy response (JSON, as its HTTP endpoint serves it)."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"a sampling strategy is a JSON object, got {type(doc).__name__}")
    per_op = doc.get("operationSampling")
    if per_op:
        floor = float(per_op.get("defaultLowerBoundTracesPerSecond") or 0.0)
        default = Rule(_check_rate(float(per_op["defaultSamplingProbability"]), "rate"), floor)
        operations = {
            str(s["operation"]): Rule(
                _check_rate(float(s["probabilisticSampling"]["samplingRate"]), "rate"), floor
            )
            for s in per_op.get("perOperationStrategies") or ()
        }
        return Strategy(default, operations)
    kind = doc.get("strategyType", PROBABILISTIC)
    if kind in (RATE_LIMITING, "RATE_LIMITING"):
        per_second = float(doc["rateLimitingSampling"]["maxTracesPerSecond"])
        if not per_second >= 0:
            raise ValueError(f"maxTracesPerSecond must be 0 or more, got {per_second}")
        return Strategy(Rule(0.0, per_second))
    if kind in (PROBABILISTIC, "PROBABILISTIC"):
        return Strategy(
            Rule(_check_rate(float(doc["probabilisticSampling"]["samplingRate"]), "rate"))
        )
    raise ValueError(f"unknown strategyType {kind!r}")


def fetch_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as reply:
        return json.loads(reply.read())


class JaegerRemoteSampler(Sampler):
    """Samples by the strategy Jaeger last served for `service`; `start()` polls for changes."""

    def __init__(
        self,
        service: str,
        settings: RemoteSettings,
        *,
        edge: bool = True,
        fetch: Callable[[str], Any] = fetch_json,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        # The process callers outside the mesh reach (the gateway): its traces are decided
        # here; every other process follows the caller (the gateway) that decided them.
        self.edge = edge
        # Trace ids decided here lately, and how: a trace's every span in this process follows
        # its root's decision, as Jaeger's clients decide at the root only. Each span decided
        # on its own (a rate limit's credit each) kept 67 of 73 traces as their root alone (a
        # tracing probe: at most 5 traces/s, 20 requests/s, co-located).
        self._decided: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._decided_lock = threading.Lock()
        self.settings = settings
        self.url = f"{settings.endpoint}/api/sampling?" + urllib.parse.urlencode(
            {"service": service}
        )
        self.fetch = fetch
        self.clock = clock
        self.failing = False
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self._apply(Strategy(Rule(settings.initial_rate)))

    def _apply(self, strategy: Strategy) -> None:
        # Swapped whole (one attribute store), so a decision never sees half of each.
        self.strategy = strategy
        self.samplers = (
            strategy.default.sampler(self.clock),
            {op: r.sampler(self.clock) for op, r in strategy.operations.items()},
        )
        metrics.TRACE_SAMPLING.clear()  # operations the last strategy named may be gone
        for op, rule in [("", strategy.default), *strategy.operations.items()]:
            if rule.rate > 0 or not rule.per_second:
                metrics.TRACE_SAMPLING.labels(op, "share").set(rule.rate)
            if rule.per_second:
                bound = "max_per_second" if rule.rate == 0 else "min_per_second"
                metrics.TRACE_SAMPLING.labels(op, bound).set(rule.per_second)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        if parent.is_valid and (not parent.is_remote or not self.edge):
            return _follow(parent.trace_flags.sampled, parent)
        with self._decided_lock:
            kept = self._decided.get(trace_id)
        if kept is not None:
            return _follow(kept, parent)
        default, operations = self.samplers
        result = operations.get(name, default).decide(parent_context, trace_id)
        with self._decided_lock:
            self._decided[trace_id] = result.decision is Decision.RECORD_AND_SAMPLE
            if len(self._decided) > DECIDED_TRACES:
                self._decided.popitem(last=False)
        return result

    def get_description(self) -> str:
        return f"JaegerRemoteSampler{{{self.service}: {self.strategy.summary()}}}"

    def poll(self) -> bool:
        """Ask Jaeger once; True when it answered with a strategy this sampler can apply."""
        try:
            strategy = parse_strategy(self.fetch(self.url))
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
            if not self.failing:
                log.warning(
                    "cannot read the sampling strategy; keeping the last one",
                    extra={"url": self.url, "error": str(exc), "strategy": self.strategy.summary()},
                )
            self.failing = True
            return False
        if self.failing:
            log.info("sampling strategy readable again", extra={"url": self.url})
        self.failing = False
        if strategy != self.strategy:
            log.info(
                "sampling strategy", extra={"service": self.service, "strategy": strategy.summary()}
            )
            metrics.TRACE_SAMPLING_UPDATES.inc()
            self._apply(strategy)
        return True

    def start(self) -> None:
        def run() -> None:
            self.poll()
            while not self.stopped.wait(self.settings.poll_s):
                self.poll()

        self.thread = threading.Thread(target=run, name="jaeger-remote-sampling", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()


def sampling_in_force(metrics_port: int, host: str = "127.0.0.1") -> dict[tuple[str, str], float]:
    """What a process samples now by its /metrics: (operation, bound) -> value, as
    `hopline_trace_sampling` exports it; empty where it samples by no remote strategy."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.labels["operation"], s.labels["bound"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "hopline_trace_sampling"
        for s in family.samples
    }
