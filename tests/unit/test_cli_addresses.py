"""The commands that dial an address refuse one that would reach another server or none,
before sending anything, exit 2, naming the flag or variable (runtime/ports.py:dial_problem).
gRPC took 127.0.0.1:87137 as port 21601: `hopline predict` answered from whatever listened
there, `hopline cache invalidate` removed entries from the wrong cache, and `127.0.0.1:`
dialled port 443 (a newcomer's probe); the Go client already refused them."""

from __future__ import annotations

import pytest

from hopline.cli.main import main
from hopline.runtime.ports import dial_problem

ID = "ab" * 32


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["predict", "hi", "--gateway", "127.0.0.1:87137"], "hopline predict: error: --gateway"),
        (["predict", "hi", "--gateway", "127.0.0.1:"], "hopline predict: error: --gateway"),
        (["bench", "--target", "127.0.0.1:99999"], "hopline bench: error: --target"),
        (["bench", "--target", "none", "--peer", "x=h:0"], "hopline bench: error: --peer x"),
        (["cache", "stats", "--cache", "127.0.0.1:87148"], "hopline cache stats: error: --cache"),
        (
            ["cache", "invalidate", "--cache", "127.0.0.1:87148", "--id", ID],
            "hopline cache invalidate: error: --cache",
        ),
    ],
)
def test_a_command_refuses_an_address_gRPC_would_take_for_another(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "the port must be a number from 1 to 65535" in err, err


def test_the_variable_is_named_when_it_gave_the_address(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOPLINE_GATEWAY_ADDR", "127.0.0.1:99999")
    assert main(["predict", "hi"]) == 2
    assert "HOPLINE_GATEWAY_ADDR '127.0.0.1:99999'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (["predict", "hi", "--gateway", ""], {}, "hopline predict: error: --gateway"),
        (["predict", "hi"], {"HOPLINE_GATEWAY_ADDR": ""}, "error: HOPLINE_GATEWAY_ADDR"),
        (["cache", "stats", "--cache", ""], {}, "hopline cache stats: error: --cache"),
        (
            ["cache", "invalidate", "--id", ID],
            {"HOPLINE_CACHE_ADDR": ""},
            "hopline cache invalidate: error: HOPLINE_CACHE_ADDR",
        ),
        (["bench", "--target", ""], {}, "hopline bench: error: --target"),
    ],
)
def test_an_empty_address_is_refused_not_replaced_by_the_default(
    argv: list[str],
    env: dict[str, str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An empty flag or variable dialled the built-in default, 127.0.0.1:8001 or :8012,
    which on a shared machine may be another mesh's: `cache invalidate` could remove another
    cache's entries (a settings probe)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "an empty address" in err, err


def test_a_ca_that_cannot_be_read_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/clients.md: an unreadable HOPLINE_TLS_CA exits 2 before sending, as the example
    clients do; `hopline predict` exited 1."""
    monkeypatch.setenv("HOPLINE_TLS_CA", "/nonexistent/ca.crt")
    assert main(["predict", "hi", "--gateway", "127.0.0.1:1"]) == 2
    assert "cannot read HOPLINE_TLS_CA" in capsys.readouterr().err


@pytest.mark.parametrize(
    "address", ["127.0.0.1:8001", "[::1]:8001", "dns:///gateway:8001", "gateway.example.com"]
)
def test_addresses_that_name_a_server_pass(address: str) -> None:
    assert dial_problem(address, "--gateway") is None
