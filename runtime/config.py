"""Service configuration: frozen dataclasses filled once from flags, then HOPLINE_* env vars.

Every field declares its env var and help text, so `--help`, the README's configuration table
and the code cannot drift apart. Flags win over env vars, env vars over defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar, get_type_hints

from hopline.observability.logs import LogFormat, LogLevel
from hopline.runtime.event_loop import EventLoop
from hopline.runtime.service_table import spec

T = TypeVar("T")


class SettingError(ValueError):
    """A setting whose value cannot work, found while a service is built (a file it names
    that does not read as it must): the service does not start, and says why in one line
    (cli/main.py exits 2)."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: from `low` (above it, with `open_low`) to
    `high`. A setting outside is refused at start-up, naming it, instead of a service that
    runs on it (a negative timeout, a zero batch) and fails on every request."""

    low: float | None = 0.0
    open_low: bool = False
    high: float | None = None

    def problem(self, value: float) -> str | None:
        if math.isnan(value):
            return "must be a number"
        if math.isinf(value):  # "1e400" and "inf" parse: a grace or interval never ending
            return "must be a finite number"
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return f"must be {'above' if self.open_low else 'at least'} {_said(self.low)}"
        if self.high is not None and value > self.high:
            return f"must be at most {_said(self.high)}"
        return None


def _said(bound: float) -> str:
    """A bound as a person writes it: 2147483647, not 2.14748e+09."""
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e12 else f"{bound:g}"


NON_NEGATIVE = Range()  # every count, size, time and rate unless its field says otherwise
POSITIVE = Range(open_low=True)  # a time or budget that 0 would make fail every request
AT_LEAST_ONE = Range(1.0)  # a count of which none would serve nothing


def env_field(env: str, default: Any, help: str, valid: Range = NON_NEGATIVE) -> Any:
    """A config field read from `--flag-name` or the env var `env`; `valid` bounds an int or
    float field's value."""
    return dataclasses.field(default=default, metadata={"env": env, "help": help, "valid": valid})


class _Invalid(argparse.ArgumentTypeError, ValueError):
    """A value a setting cannot take: argparse says its message for a flag (it said
    "invalid _parse_bool value: 'maybe'"), the env reader for a variable."""


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    # Empty is refused, not false: HOPLINE_REFLECTION= turned a default-on feature off.
    raise _Invalid(f"not a boolean: {raw!r} (use true/false)")


def _enum_parser(kind: type[enum.Enum]) -> Any:
    def parse(raw: str) -> enum.Enum:
        try:
            return kind(raw.strip().lower())
        except ValueError:
            names = ", ".join(str(m.value) for m in kind)
            raise _Invalid(f"{raw!r} is not one of: {names}") from None

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def _converter(kind: Any) -> Any:
    if kind is bool:
        return _parse_bool
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return _enum_parser(kind)
    if kind in (int, float, str):
        return kind
    raise TypeError(f"unsupported config field type {kind!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Add one `--flag` per dataclass field, showing its env var and default in --help."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        env = f.metadata["env"]
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_converter(hints[f.name]),
            default=None,
            help=f"{f.metadata['help']} [env {env}; default {_shown(f.default)}]",
        )


def _shown(default: Any) -> str:
    return repr(default.value) if isinstance(default, enum.Enum) else repr(default)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build the frozen config: flag if given, else env var, else the field's default."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        flag = getattr(ns, f.name, None)
        if flag is not None:
            values[f.name] = flag
            _check_range(f, hints[f.name], flag, f"--{f.name.replace('_', '-')} {flag!r}")
            continue
        raw = os.environ.get(f.metadata["env"])
        if raw is not None:
            try:
                values[f.name] = _converter(hints[f.name])(raw)
            except ValueError as exc:
                _refuse(f"invalid {f.metadata['env']}={raw!r}: {exc}")
            _check_range(f, hints[f.name], values[f.name], f"{f.metadata['env']}={raw!r}")
    return cls(**values)


# What no numeric setting means past, whatever its own range: gRPC takes its integers as C
# ints (HOPLINE_MAX_MESSAGE_BYTES=2147483648 was an OverflowError traceback), and a time of
# 1e300 s overflowed where it was converted (a drain that never ended, a Milvus call that
# failed at once). About 31 years of seconds.
MOST_INT = 2**31 - 1
MOST_FLOAT = 1e9
MAX_CONNECTION_AGE_S = 24 * 86_400  # gRPC's age is a C int of milliseconds: 24.8 days at most


def _check_range(f: dataclasses.Field[Any], kind: Any, value: Any, given: str) -> None:
    if kind not in (int, float):
        return
    problem = f.metadata["valid"].problem(value)
    if problem is None:
        problem = Range(low=None, high=MOST_INT if kind is int else MOST_FLOAT).problem(value)
    if problem is not None:
        _refuse(f"invalid {given}: {problem}")


class SettingRefused(SystemExit):
    """A setting no service can run on: exit status 2, as every other refusal at start
    (a SystemExit carrying its message exited 1); str() is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _refuse(message: str) -> NoReturn:
    sys.stderr.write(message + "\n")
    raise SettingRefused(message)


def load(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser, cls)
    return from_namespace(cls, parser.parse_args(argv))


def setting_of(config: Any, name: str) -> str:
    """The env var a config field is read from (`listen` -> HOPLINE_GATEWAY_ADDR), for a
    message that names what to change."""
    field = next(f for f in dataclasses.fields(config) if f.name == name)
    return str(field.metadata["env"])


def describe(cls: type[Any]) -> list[tuple[str, str, str, str]]:
    """(flag, env var, default, help) rows, for docs."""
    return [
        ("--" + f.name.replace("_", "-"), f.metadata["env"], repr(f.default), f.metadata["help"])
        for f in dataclasses.fields(cls)
    ]


# Addresses and ports come from the service table, their one source.
def listen_field(service: str) -> Any:
    """The address a service binds: its HOPLINE_<NAME>_ADDR, which the gateway also dials."""
    row = spec(service)
    return env_field(row.addr_env, row.default_addr, "address to bind")


def upstream_field(service: str) -> Any:
    """Where a caller dials `service`: the same variable and default the service binds."""
    row = spec(service)
    return env_field(row.addr_env, row.default_addr, f"where the {service} listens")


def model_refresh_field(what: str) -> Any:
    """HOPLINE_MODEL_REFRESH_S: how often a service re-reads the model repository's listing
    (the gateway: the model list, from inference)."""
    return env_field("HOPLINE_MODEL_REFRESH_S", 10.0, what, valid=POSITIVE)


def metrics_port_field(service: str) -> Any:
    return env_field(
        "HOPLINE_METRICS_PORT",
        spec(service).metrics_port,
        "port of the Prometheus /metrics endpoint (0: none)",
        valid=Range(high=65535),
    )


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Settings every service shares; each service's config extends it."""

    listen: str = env_field("HOPLINE_LISTEN", "", "host:port or unix:PATH to bind")
    drain_delay_s: float = env_field(
        "HOPLINE_DRAIN_DELAY_S",
        0.5,
        "on SIGTERM, seconds to report NOT_SERVING while still accepting, so balancers move away",
        valid=Range(high=3600),
    )
    drain_grace_s: float = env_field(
        "HOPLINE_DRAIN_GRACE_S",
        8.0,
        "seconds in-flight RPCs get to finish after accepting stops",
        valid=Range(high=3600),
    )
    max_message_bytes: int = env_field(
        "HOPLINE_MAX_MESSAGE_BYTES",
        4 * 1024 * 1024,
        "largest gRPC message accepted or sent",
        valid=AT_LEAST_ONE,
    )
    max_connection_age_s: float = env_field(
        "HOPLINE_MAX_CONNECTION_AGE_S",
        60.0,
        "seconds before a client connection is asked to reconnect (GOAWAY; its streams finish "
        "first), so callers resolve DNS again and find replicas added since (0: never)",
        valid=Range(high=MAX_CONNECTION_AGE_S),  # gRPC takes it in ms, as a C int
    )
    event_loop: EventLoop = env_field(  # noqa: RUF009 (an enum default, read once)
        "HOPLINE_EVENT_LOOP",
        EventLoop.UVLOOP,
        "uvloop (faster hops: runtime/event_loop.py) or asyncio (the standard library's loop)",
    )
    log_level: LogLevel = env_field(  # noqa: RUF009 (an enum default, read once)
        "HOPLINE_LOG_LEVEL", LogLevel.INFO, "debug, info, warning or error"
    )
    log_format: LogFormat = env_field(  # noqa: RUF009 (an enum default, read once)
        "HOPLINE_LOG_FORMAT", LogFormat.JSON, "json (structured) or text"
    )
    health_port: int = env_field(
        "HOPLINE_HEALTH_PORT",
        0,
        "a plaintext port serving grpc.health.v1 alone, on the listen address's host, for "
        "probes that cannot speak TLS (Kubernetes' gRPC probes) to a TLS-only service (0: none)",
        valid=Range(high=65535),
    )
    metrics_host: str = env_field(
        "HOPLINE_METRICS_HOST",
        "127.0.0.1",
        "address the /metrics endpoint binds (0.0.0.0 in a pod)",
    )
    metrics_port: int = env_field(
        "HOPLINE_METRICS_PORT", 0, "port of /metrics (0: none)", valid=Range(high=65535)
    )
    reflection: bool = env_field(
        "HOPLINE_REFLECTION", True, "serve gRPC server reflection on the service's port"
    )
    # TLS (hopline.runtime.tls): `{name}` in a path is the service's name, so one environment
    # serves every process of a mesh.
    tls_cert: str = env_field(
        "HOPLINE_TLS_CERT", "", "PEM certificate this process presents (unset: plaintext)"
    )
    tls_key: str = env_field("HOPLINE_TLS_KEY", "", "PEM private key of HOPLINE_TLS_CERT")
    tls_ca: str = env_field(
        "HOPLINE_TLS_CA", "", "PEM CA that verifies the services called and client certificates"
    )
    tls_peers: str = env_field(
        "HOPLINE_TLS_PEERS",
        "gateway,operator",
        "client certificate names (DNS SAN or CN) this service serves ('*': any the CA "
        "signed; empty: no client certificate asked)",
    )
    # Tests make one hop the slow one to check that traces and reports blame the right hop.
    test_delay_ms: float = env_field(
        "HOPLINE_TEST_DELAY_MS", 0.0, "TEST ONLY: added to every RPC this service serves"
    )
    # Tests make one replica the broken one to check that the gateway ejects it.
    test_fault: str = env_field(
        "HOPLINE_TEST_FAULT",
        "",
        "TEST ONLY: a status code name (e.g. INTERNAL) every service RPC fails with",
    )
