"""HOPLINE_TLS_* read into credentials (runtime/tls.py): which settings mean plaintext, which
combinations are refused with a message that says what to set, and `{name}` per role. The
handshakes themselves are proven with real certificates in tests/mesh/test_tls_mesh.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hopline.cli.certs import make_certs, make_leaf
from hopline.runtime.tls import (
    ANY_PEER,
    ClientCertificates,
    ServerCertificates,
    TlsConfigError,
    TlsFiles,
    client_tls,
    parse_peers,
    server_credentials,
)


def test_no_certificate_and_no_ca_is_plaintext() -> None:
    plain = TlsFiles()
    assert not plain.enabled
    assert server_credentials(plain, "gateway,operator") is None
    assert client_tls(plain, "cache") is None


def test_name_in_a_path_becomes_the_role() -> None:
    files = TlsFiles("tls/{name}.crt", "tls/{name}.key", "tls/ca.crt").for_role("cache")
    assert files == TlsFiles("tls/cache.crt", "tls/cache.key", "tls/ca.crt")
    environ = {"HOPLINE_TLS_CERT": "t/{name}.crt", "HOPLINE_TLS_KEY": "t/{name}.key"}
    assert TlsFiles.from_env(environ=environ).cert == "t/operator.crt"


@pytest.mark.parametrize(
    ("files", "peers", "says"),
    [
        (TlsFiles(cert="a.crt"), "", "HOPLINE_TLS_KEY"),
        (TlsFiles(key="a.key"), "", "HOPLINE_TLS_CERT"),
        (TlsFiles("a.crt", "a.key"), "gateway", "HOPLINE_TLS_CA"),
        (TlsFiles(ca="ca.crt"), "gateway,operator", "would serve plaintext"),
        (TlsFiles(ca="ca.crt"), "", "would serve plaintext"),
    ],
)
def test_a_server_with_settings_that_cannot_work_is_refused(
    files: TlsFiles, peers: str, says: str
) -> None:
    with pytest.raises(TlsConfigError, match=says):
        server_credentials(files, peers)


def test_a_certificate_file_that_cannot_be_read_is_named_with_its_setting(
    tmp_path: Path,
) -> None:
    """A Secret mounted under other key names, or a folder where the file should be: the
    service says which setting names what, where it raised a bare OSError (a traceback)."""
    make_certs(tmp_path, ["cache"])
    missing = TlsFiles(str(tmp_path / "tls.crt"), str(tmp_path / "cache.key"))
    with pytest.raises(TlsConfigError, match=r"cannot read HOPLINE_TLS_CERT=.*tls\.crt"):
        server_credentials(missing, "")
    a_folder = TlsFiles(str(tmp_path / "cache.crt"), str(tmp_path))
    with pytest.raises(TlsConfigError, match="cannot read HOPLINE_TLS_KEY="):
        server_credentials(a_folder, "")


@pytest.mark.parametrize("ca", ["garbage\n", ""])
def test_a_ca_file_without_a_certificate_is_named(tmp_path: Path, ca: str) -> None:
    """A server's bind failed with "Failed to bind to address" (blamed on the address
    setting), a client's handshake with gRPC core's lines."""
    make_certs(tmp_path, ["cache", "operator"])
    (tmp_path / "ca.crt").write_text(ca)
    server = TlsFiles(
        str(tmp_path / "cache.crt"), str(tmp_path / "cache.key"), str(tmp_path / "ca.crt")
    )
    with pytest.raises(TlsConfigError, match=r"HOPLINE_TLS_CA=.* holds no PEM certificate"):
        server_credentials(server, "gateway")
    with pytest.raises(TlsConfigError, match=r"HOPLINE_TLS_CA=.* holds no PEM certificate"):
        client_tls(TlsFiles(ca=str(tmp_path / "ca.crt")), "cache")


def test_a_clients_key_that_is_not_its_certificates_is_named(tmp_path: Path) -> None:
    """`hopline predict` with another role's key printed gRPC core's "Invalid private key"
    lines, then UNAVAILABLE "Failed to create security handshaker"."""
    make_certs(tmp_path, ["operator", "gateway"])
    files = TlsFiles(
        str(tmp_path / "operator.crt"), str(tmp_path / "gateway.key"), str(tmp_path / "ca.crt")
    )
    with pytest.raises(TlsConfigError, match="are not a certificate and its private key"):
        client_tls(files, "cache")


def test_a_client_needs_the_ca_and_both_halves_of_its_certificate() -> None:
    with pytest.raises(TlsConfigError, match="HOPLINE_TLS_CA"):
        client_tls(TlsFiles("a.crt", "a.key"), "cache")
    with pytest.raises(TlsConfigError, match="go together"):
        client_tls(TlsFiles(cert="a.crt", ca="ca.crt"), "cache")


def test_an_unreadable_file_is_named() -> None:
    with pytest.raises(TlsConfigError, match=r"/nonexistent/ca\.crt"):
        client_tls(TlsFiles(ca="/nonexistent/ca.crt"), "cache")


def test_peers_are_a_comma_list() -> None:
    assert parse_peers(" gateway, operator ,,") == {"gateway", "operator"}
    assert parse_peers("") == frozenset()
    assert ANY_PEER in parse_peers("*")


def test_certificates_renewed_file_by_file_are_taken_once_they_match(tmp_path: Path) -> None:
    """A renewal that lands the new key before its certificate: neither a port nor a client
    takes the mismatched pair (they keep the ones in use); both take the pair once whole,
    and only once."""
    live = make_certs(tmp_path / "tls", ("gateway",))
    files = TlsFiles(str(live / "gateway.crt"), str(live / "gateway.key"), str(live / "ca.crt"))
    port, dialler = ServerCertificates(files), ClientCertificates(files, "cache", recheck_s=0.0)
    assert port.fetch() is None
    assert dialler.renewed() is None
    first = dialler.current

    staging = tmp_path / "staging"
    staging.mkdir()
    for name in ("ca.crt", "ca.key"):
        shutil.copy(live / name, staging / name)
    make_leaf(staging, "gateway")
    os.replace(staging / "gateway.key", live / "gateway.key")
    assert port.fetch() is None
    assert dialler.renewed() is None
    os.replace(staging / "gateway.crt", live / "gateway.crt")

    assert port.fetch() is not None
    renewed = dialler.renewed()
    assert renewed is not None
    assert renewed is not first
    assert dialler.current is renewed
    assert port.fetch() is None
    assert dialler.renewed() is None
