"""A numeric setting outside what it can mean is refused when the config is read
(runtime/config.py:Range), naming the variable or flag and the bound, before a service
starts: a zero timeout or a negative batch used to start a service that failed every
request, or did something no one asked for."""

from __future__ import annotations

import dataclasses

import pytest

from hopline.cache.config import CacheConfig
from hopline.gateway.config import GatewayConfig
from hopline.observability.logs import LogFormat, LogLevel
from hopline.runtime import config as cfg
from hopline.runtime.service_table import SERVICES
from hopline.services.inference.service import InferenceConfig


@pytest.mark.parametrize(
    ("env", "raw", "said"),
    [
        ("HOPLINE_UPSTREAM_TIMEOUT_S", "0", "must be above 0"),
        ("HOPLINE_CACHE_BUDGET_MS", "-5", "must be above 0"),
        ("HOPLINE_CACHE_BUDGET_MS", "nan", "must be a number"),
        ("HOPLINE_DRAIN_GRACE_S", "1e400", "must be a finite number"),  # float("1e400") is inf
        ("HOPLINE_MODEL_REFRESH_S", "inf", "must be a finite number"),
        ("HOPLINE_GATEWAY_BATCH_MAX_ROWS", "0", "must be at least 1"),
        ("HOPLINE_MAX_TEXT_BYTES", "0", "must be at least 1"),
        ("HOPLINE_GATEWAY_STORE_LINGER_MS", "-1", "must be at least 0"),
        ("HOPLINE_GATEWAY_MAX_IN_FLIGHT", "-1", "must be at least 0"),
        ("HOPLINE_UPSTREAM_EJECT_FAILURE_PERCENT", "150", "must be at most 100"),
        ("HOPLINE_GATEWAY_SPECULATE_MAX_HIT_RATE", "1.5", "must be at most 1"),
        ("HOPLINE_METRICS_PORT", "70000", "must be at most 65535"),
        ("HOPLINE_UPSTREAM_RETRY_ATTEMPTS", "6", "must be at most 5"),  # gRPC would clamp it
        ("HOPLINE_UPSTREAM_RETRY_TOKENS", "5000", "must be at most 1000"),  # and this one
        # No bound of their own: OverflowError tracebacks, a drain that never ended, a fork
        # of workers without end, a start hung making channels (a settings probe).
        ("HOPLINE_MAX_MESSAGE_BYTES", "2147483648", "must be at most 2147483647"),
        ("HOPLINE_MAX_CONNECTION_AGE_S", "1e300", "must be at most 2073600"),
        ("HOPLINE_DRAIN_DELAY_S", "1e300", "must be at most 3600"),
        ("HOPLINE_GATEWAY_WORKERS", str(2**63), "must be at most 256"),
        ("HOPLINE_CHANNELS_PER_UPSTREAM", str(2**63), "must be at most 64"),
        ("HOPLINE_MODEL_REFRESH_S", "1e300", "must be at most 1000000000"),
        # Empty is not false: it turned a default-on feature off.
        ("HOPLINE_REFLECTION", "", "not a boolean: '' (use true/false)"),
    ],
)
def test_the_gateway_refuses_a_setting_outside_its_range(
    monkeypatch: pytest.MonkeyPatch, env: str, raw: str, said: str
) -> None:
    monkeypatch.setenv(env, raw)
    with pytest.raises(SystemExit) as refused:
        cfg.load(GatewayConfig, [])
    assert str(refused.value) == f"invalid {env}={raw!r}: {said}"
    assert refused.value.code == 2  # as every other refusal at start (it was 1)


def test_a_flag_is_held_to_the_same_range(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as refused:
        cfg.load(GatewayConfig, ["--max-text-bytes", "0"])
    assert str(refused.value) == "invalid --max-text-bytes 0: must be at least 1"
    monkeypatch.setenv("HOPLINE_CACHE_TTL_S", "0")
    with pytest.raises(SystemExit, match="HOPLINE_CACHE_TTL_S='0': must be above 0"):
        cfg.load(CacheConfig, [])
    monkeypatch.delenv("HOPLINE_CACHE_TTL_S")
    # 0 passed the range and raised ValueError in the cache's constructor: a traceback.
    monkeypatch.setenv("HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES", "0")
    with pytest.raises(SystemExit, match="EXACT_INDEX_MAX_ENTRIES='0': must be at least 1"):
        cfg.load(CacheConfig, [])
    monkeypatch.delenv("HOPLINE_CACHE_EXACT_INDEX_MAX_ENTRIES")
    monkeypatch.setenv("HOPLINE_INFERENCE_NICE", "20")
    with pytest.raises(SystemExit, match="HOPLINE_INFERENCE_NICE='20': must be at most 19"):
        cfg.load(InferenceConfig, [])
    monkeypatch.delenv("HOPLINE_INFERENCE_NICE")
    # 100,000 intra-op threads wedged the start inside ONNX Runtime, past SIGTERM.
    monkeypatch.setenv("HOPLINE_INFERENCE_THREADS", "100000")
    with pytest.raises(SystemExit, match="THREADS='100000': must be at most 1024"):
        cfg.load(InferenceConfig, [])


@pytest.mark.parametrize(
    ("env", "raw", "said"),
    [
        ("HOPLINE_LOG_LEVEL", "verbose", "'verbose' is not one of: debug, info, warning, error"),
        ("HOPLINE_LOG_FORMAT", "xml", "'xml' is not one of: json, text"),
    ],
)
def test_a_word_setting_outside_its_words_is_refused(
    monkeypatch: pytest.MonkeyPatch, env: str, raw: str, said: str
) -> None:
    """HOPLINE_LOG_LEVEL=verbose was logging's own traceback at start; HOPLINE_LOG_FORMAT=xml
    logged JSON while the config line said xml."""
    monkeypatch.setenv(env, raw)
    with pytest.raises(SystemExit) as refused:
        cfg.load(GatewayConfig, [])
    assert str(refused.value) == f"invalid {env}={raw!r}: {said}"
    monkeypatch.setenv(env, "WARNING" if env.endswith("LEVEL") else " Text")
    config = cfg.load(GatewayConfig, [])
    assert (config.log_level, config.log_format) in {
        (LogLevel.WARNING, LogFormat.JSON),
        (LogLevel.INFO, LogFormat.TEXT),
    }


def test_the_edges_and_the_meaningful_zeros_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 where the settings table gives it a meaning (no limit, none, off) stays valid."""
    for env, raw in {
        "HOPLINE_GATEWAY_MAX_IN_FLIGHT": "0",  # no limit
        "HOPLINE_GATEWAY_EXACT_ENTRIES": "0",  # no local tier
        "HOPLINE_GATEWAY_BATCH_LINGER_MS": "0",  # one event-loop turn
        "HOPLINE_METRICS_PORT": "65535",
        "HOPLINE_GATEWAY_BATCH_MAX_ROWS": "1",  # one RPC per request
    }.items():
        monkeypatch.setenv(env, raw)
    config = cfg.load(GatewayConfig, [])
    assert (config.max_in_flight, config.local_exact_entries, config.metrics_port) == (0, 0, 65535)


def test_every_services_defaults_are_in_range() -> None:
    """The defaults themselves must pass the ranges they are read against."""
    for service in SERVICES:
        config_cls, _ = service.load()
        for f in dataclasses.fields(config_cls):
            if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                problem = f.metadata["valid"].problem(f.default)
                assert problem is None, (service.name, f.metadata["env"], problem)


def test_a_flag_of_words_says_the_words_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse named the parser's function: "invalid _parse_bool value: 'maybe'"."""
    with pytest.raises(SystemExit) as refused:
        cfg.load(GatewayConfig, ["--reflection", "maybe"])
    assert refused.value.code == 2
    said = capsys.readouterr().err
    assert "argument --reflection: not a boolean: 'maybe' (use true/false)" in said, said
    with pytest.raises(SystemExit):
        cfg.load(GatewayConfig, ["--event-loop", "bogus"])
    said = capsys.readouterr().err
    assert "argument --event-loop: 'bogus' is not one of: uvloop, asyncio" in said, said


def test_the_cache_bounds_its_timeouts_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLINE_CACHE_LOAD_TIMEOUT_S", "1e300")
    with pytest.raises(SystemExit, match=r"LOAD_TIMEOUT_S='1e300': must be at most 1000000000"):
        cfg.load(CacheConfig, [])
    monkeypatch.delenv("HOPLINE_CACHE_LOAD_TIMEOUT_S")
    monkeypatch.setenv("HOPLINE_CACHE_EMBED_THREADS", str(2**63))
    with pytest.raises(SystemExit, match="must be at most 1024"):
        cfg.load(CacheConfig, [])
