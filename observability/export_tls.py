"""The OTLP exporter's TLS settings, checked before a process starts exporting.

The SDK's exporter reads OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE, _CLIENT_KEY and
_CLIENT_CERTIFICATE when the endpoint is not plaintext; a file it cannot read is logged once
and dropped (the channel falls back to the system's roots and no client certificate), a key
that does not match its certificate or an `http://` endpoint beside them is not noticed at
all. Each of those leaves a service running whose spans never reach the collector, or reach
it in the clear, with nothing an operator would see. `check_export_tls` turns them into one
error at start, naming the variable and what to change (cli/main.py does not start then).
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from urllib.parse import urlparse

PREFIX = "OTEL_EXPORTER_OTLP_"
TRACES = "OTEL_EXPORTER_OTLP_TRACES_"


@dataclasses.dataclass(frozen=True)
class ExportTls:
    """The files the trace exporter will use, by the variable each came from."""

    prefix: str  # the variables' (PREFIX, or TRACES where its CERTIFICATE is set)
    ca: tuple[str, str] | None  # (variable, path)
    client_key: tuple[str, str] | None
    client_cert: tuple[str, str] | None
    plaintext: bool  # the exporter's channel is insecure

    @classmethod
    def of(cls, environ: Mapping[str, str], endpoint: str) -> ExportTls:
        """As the SDK's span exporter picks them: the TRACES_ trio when its CERTIFICATE is
        set, else the generic one; plaintext for an `http://` endpoint unless an INSECURE
        variable says otherwise (the traces one first)."""
        prefix = TRACES if environ.get(TRACES + "CERTIFICATE") is not None else PREFIX

        def named(suffix: str) -> tuple[str, str] | None:
            value = environ.get(prefix + suffix)
            return (prefix + suffix, value) if value else None

        scheme = urlparse(endpoint).scheme
        insecure = environ.get(TRACES + "INSECURE") or environ.get(PREFIX + "INSECURE")
        if scheme == "https":
            plaintext = False
        elif insecure is not None:
            plaintext = insecure.strip().lower() == "true"
        else:
            plaintext = scheme == "http"
        files = (named("CERTIFICATE"), named("CLIENT_KEY"), named("CLIENT_CERTIFICATE"))
        return cls(prefix, *files, plaintext)

    @property
    def mode(self) -> str:
        """For the start-up log: off, on (the collector's certificate checked) or mutual."""
        if self.plaintext:
            return "off"
        return "mutual" if self.client_cert else "on"

    @property
    def files(self) -> list[tuple[str, str]]:
        return [f for f in (self.ca, self.client_key, self.client_cert) if f is not None]


def check_export_tls(environ: Mapping[str, str], endpoint: str) -> ExportTls:
    """The exporter's TLS settings, or ValueError saying which setting cannot work."""
    tls = ExportTls.of(environ, endpoint)
    if tls.plaintext:
        if tls.files:
            variable, _ = tls.files[0]
            raise ValueError(
                f"{variable} is set but spans go to {endpoint!r} in plaintext: "
                "use an https:// endpoint (or unset the certificate settings)"
            )
        return tls
    for variable, path in tls.files:
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot read {variable}={path!r}: {exc.strerror}") from None
    if (tls.client_key is None) != (tls.client_cert is None):
        have, missing = ("CLIENT_KEY", "CLIENT_CERTIFICATE")
        if tls.client_key is None:
            have, missing = missing, have
        raise ValueError(
            f"{tls.prefix}{have} is set without {tls.prefix}{missing}: set both, or neither"
        )
    if tls.ca is not None:
        try:
            ssl.create_default_context(cafile=tls.ca[1])
        except ssl.SSLError as exc:
            raise ValueError(
                f"{tls.ca[0]}={tls.ca[1]!r} holds no PEM certificate: {exc.reason}"
            ) from None
    if tls.client_cert is not None and tls.client_key is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
                tls.client_cert[1], tls.client_key[1]
            )
        except ssl.SSLError as exc:
            raise ValueError(
                f"{tls.client_cert[0]} and {tls.client_key[0]} are not a certificate and its "
                f"key: {exc.reason or exc}"
            ) from None
    return tls
