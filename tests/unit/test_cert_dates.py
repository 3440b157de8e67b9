"""Certificates past their dates are said at start (runtime/cert_dates.py): gRPC served an
expired certificate without a word, and every client's handshake failed with a message on
the client's side. Certificates made here with `cryptography` (openssl cannot date one in
the past on every version)."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hopline.runtime.cert_dates import check_dates
from hopline.runtime.tls import ServerCertificates, TlsFiles

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


def self_signed(folder: Path, name: str, start: datetime.datetime, end: datetime.datetime) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .sign(key, hashes.SHA256())
    )
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path = folder / f"{name}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.mark.parametrize(
    ("name", "start", "end", "said", "level"),
    [
        ("expired", NOW - 30 * DAY, NOW - DAY, "expired on", logging.ERROR),
        ("future", NOW + DAY, NOW + 30 * DAY, "is not valid until", logging.ERROR),
        ("soon", NOW - DAY, NOW + 2 * DAY, "expires on", logging.WARNING),
    ],
)
def test_a_service_reading_its_certificate_says_what_is_wrong_with_its_dates(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    name: str,
    start: datetime.datetime,
    end: datetime.datetime,
    said: str,
    level: int,
) -> None:
    cert = self_signed(tmp_path, name, start, end)
    files = TlsFiles(cert=str(cert), key=str(tmp_path / f"{name}.key"), ca="")
    with caplog.at_level(logging.WARNING, logger="hopline.runtime.tls"):
        ServerCertificates(files).configuration()  # what a service does at start and renewal
    [record] = [r for r in caplog.records if said in r.getMessage()]
    assert record.levelno == level
    assert f"HOPLINE_TLS_CERT={str(cert)!r}" in record.getMessage()


def test_a_certificate_in_its_dates_is_not_mentioned(tmp_path: Path) -> None:
    cert = self_signed(tmp_path, "fine", NOW - DAY, NOW + 90 * DAY)
    assert check_dates("HOPLINE_TLS_CERT", str(cert), cert.read_bytes()) == ""
