"""Upstream and listen addresses gRPC can never use are refused before anything dials them.
gRPC resolves a target whose scheme it has no resolver for as a DNS name, whole: a gateway
given HOPLINE_CACHE_ADDR=http://127.0.0.1:21312 went SERVING and failed every cache call
open ("Misformatted domain name"), and one given such an inference address, or one with a
space around it, logged "waiting for inference" every 5 s for ever."""

from __future__ import annotations

import dataclasses

import pytest

from hopline.gateway.config import GatewayConfig
from hopline.runtime.ports import port_problem


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:21312", "https://cache:8012", "grpc://inference:8013", "tcp://h:1"]
)
@pytest.mark.parametrize("listen", [False, True])
def test_a_url_of_a_scheme_gRPC_does_not_resolve_is_a_problem(url: str, listen: bool) -> None:
    problem = port_problem(url, listen=listen)
    assert problem is not None
    assert problem.startswith(f"{url!r}: gRPC addresses are host:port, dns:///host:port")
    assert problem.endswith(f"; {url.partition(':')[0]}:// is no scheme gRPC resolves")


@pytest.mark.parametrize("address", [" 127.0.0.1:8013", "127.0.0.1:8013 ", "dns:///cache:8012\n"])
@pytest.mark.parametrize("listen", [False, True])
def test_an_address_with_whitespace_around_it_is_a_problem(address: str, listen: bool) -> None:
    assert port_problem(address, listen=listen) == (
        f"{address!r}: whitespace around the address (gRPC looks it up as part of the host)"
    )


@pytest.mark.parametrize(
    "address",
    [
        "dns:///cache:8012",
        "dns://8.8.8.8/cache.example:8012",
        "dns:cache:8012",
        "DNS:///cache:8012",  # gRPC matches schemes without regard to case
        "ipv4:127.0.0.1:8001,127.0.0.2:8001",
        "ipv6:[::1]:8001",
        "unix:/tmp/x.sock",
        "unix:///tmp/x.sock",
        "unix-abstract:hopline",
        "vsock:3:8001",
        "[::1]:8001",
        "cache:8012",
        "inproc",
    ],
)
def test_the_forms_gRPC_resolves_are_still_no_problem(address: str) -> None:
    assert port_problem(address) is None


def test_the_gateway_names_the_setting_of_a_url_or_spaced_upstream() -> None:
    config = dataclasses.replace(
        GatewayConfig(),
        tokenizer_addr="dns:///tokenizer:8011",
        cache_addr="http://127.0.0.1:21312",
        inference_addr=" 127.0.0.1:8013",
        postprocess_addr="127.0.0.1:8014",
    )
    problems = config.address_problems()
    assert len(problems) == 2
    assert problems[0].startswith("HOPLINE_CACHE_ADDR='http://127.0.0.1:21312': gRPC addresses")
    assert problems[1].startswith("HOPLINE_INFERENCE_ADDR=' 127.0.0.1:8013': whitespace")


def test_an_upstream_at_the_gateways_own_address_is_refused() -> None:
    """A gateway told to find its tokenizer at its own address answered every request
    INTERNAL "tokenize failed with UNIMPLEMENTED", and one told the same of inference waited
    for itself for ever (a settings probe)."""
    config = dataclasses.replace(
        GatewayConfig(), listen="127.0.0.1:21400", inference_addr="127.0.0.1:21400"
    )
    assert config.address_problems() == [
        "HOPLINE_INFERENCE_ADDR='127.0.0.1:21400' is the gateway's own address "
        "(HOPLINE_GATEWAY_ADDR): give the inference service's"
    ]
