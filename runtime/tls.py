"""TLS at the front door, mTLS between services, and who may call an internal service.

One set of settings for every process (`HOPLINE_TLS_CERT`, `HOPLINE_TLS_KEY`, `HOPLINE_TLS_CA`):
`{name}` in a path is replaced by the process's role, so one environment serves the whole
mesh (`.hopline/tls/{name}.crt` is `gateway.crt` in the gateway, `cache.crt` in the cache and
`operator.crt` in the CLI tools and the launcher's probes). With no certificate set, every
server and channel is plaintext, as before.

- A service presents its certificate to its callers and, as a client, to the services it
  calls; it verifies theirs against the CA.
- A client checks that the server is the service it meant to reach: the server's certificate
  must name that service (`grpc.ssl_target_name_override`), whatever address it dialled.
- An internal service requires a client certificate and serves its RPCs only to the
  identities in `HOPLINE_TLS_PEERS` (the gateway and an operator by default), so a client
  holding a certificate the CA signed for another role still cannot Store or Lookup around
  the gateway (`PeerCheck`: PERMISSION_DENIED). Health and reflection answer any certificate
  the CA signed: probes need them and they reveal no data.
- The gateway (the front door) asks for no client certificate by default: tenants come from
  API keys (`HOPLINE_GATEWAY_TLS_PEERS` can require one).

Certificates are re-read when their files change, so a renewal (cert-manager rewriting a
Secret volume in place) needs no restart: a server's port hands each new connection the
current files (`ServerCertificates.fetch`, which gRPC asks before every handshake), and the
gateway's channels to its upstreams are dialled again with them (`ClientCertificates`,
checked at most every TLS_RECHECK_S). Connections already open keep their handshake. Files
that do not make a valid set (a certificate replaced before its key) leave the ones in use,
with a warning, until they change again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import grpc

from hopline.runtime.cert_dates import check_dates
from hopline.runtime.errors import clip
from hopline.runtime.file_watch import FileWatch
from hopline.runtime.interceptors import (
    Behaviour,
    Context,
    RpcWrapper,
    StreamBehaviour,
)

CERT_ENV, KEY_ENV, CA_ENV = "HOPLINE_TLS_CERT", "HOPLINE_TLS_KEY", "HOPLINE_TLS_CA"
PEERS_ENV = "HOPLINE_TLS_PEERS"
DEFAULT_PEERS = "gateway,operator"
OPERATOR = "operator"  # the role of the CLI tools and the launcher's probes
ANY_PEER = "*"
TLS_RECHECK_S = 2.0  # how often a client compares its certificate files with those it dialled

log = logging.getLogger("hopline.runtime.tls")


class TlsConfigError(SystemExit):
    """Settings that cannot work together; the message says which and how to fix them."""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """This process's certificate and key and the mesh's CA, `{name}` already replaced."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @classmethod
    def of(cls, config: Any, role: str) -> TlsFiles:
        """From a config dataclass with tls_cert, tls_key and tls_ca (runtime/config.py)."""
        return cls(config.tls_cert, config.tls_key, config.tls_ca).for_role(role)

    @classmethod
    def from_env(cls, role: str = OPERATOR, environ: Mapping[str, str] = os.environ) -> TlsFiles:
        """For a client that has no service config: the CLI, bench, the launcher's probes."""
        get = environ.get
        return cls(get(CERT_ENV, ""), get(KEY_ENV, ""), get(CA_ENV, "")).for_role(role)

    def for_role(self, role: str) -> TlsFiles:
        return TlsFiles(*(p.replace("{name}", str(role)) for p in (self.cert, self.key, self.ca)))

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def _read(self, path: str, env: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise TlsConfigError(
                f"cannot read {env}={path!r}: {exc.strerror} (make certs creates a local set)"
            ) from None


class ServerCertificates:
    """A port's certificate, key and CA, read again for the next handshake once they change."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._watch = FileWatch([files.cert, files.key, files.ca])

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        files = self.files
        # Read first: a missing or unreadable file is named with its setting, not raised
        # from the pair check below as a bare OSError.
        key, cert = files._read(files.key, KEY_ENV), files._read(files.cert, CERT_ENV)
        root = files._read(files.ca, CA_ENV) if files.ca else None
        _check_pair(files)
        _check_ca(files.ca, root)
        check_dates(CERT_ENV, files.cert, cert)
        if root is not None:
            check_dates(CA_ENV, files.ca, root)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=root)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question before each handshake: a new configuration, or None to keep the
        one in use. Runs on a gRPC thread: it must not raise."""
        if not self._watch.changed():
            return None  # a set that does not work is reported once, until it changes
        try:
            configuration = self.configuration()
        except (TlsConfigError, OSError, ValueError) as exc:
            log.warning(
                "TLS files changed but do not make a certificate, its key and a CA; the "
                "ones in use stay",
                extra={"cert": self.files.cert, "error": str(exc)},
            )
            return None
        log.info("TLS certificate re-read for new connections", extra={"cert": self.files.cert})
        return configuration


def server_credentials(files: TlsFiles, peers: str) -> grpc.ServerCredentials | None:
    """Credentials for a service's port; None when it has no certificate (plaintext).

    With `peers` set, a client certificate the CA signed is required in the handshake. The
    files are re-read for new connections when they change (ServerCertificates).
    """
    if not files.cert:
        if files.key:
            raise TlsConfigError(f"{KEY_ENV} is set without {CERT_ENV}: set both, or neither")
        if files.ca:
            # A CA alone is a client's setting; a port opened with it served plaintext with
            # no word, to an operator who had set TLS up (a settings probe).
            raise TlsConfigError(
                f"{CA_ENV} is set without {CERT_ENV} and {KEY_ENV}: this service would serve "
                f"plaintext; set its certificate and key (make certs creates a local set), or "
                f"unset {CA_ENV}"
            )
        return None
    if not files.key:
        raise TlsConfigError(f"{CERT_ENV} is set without {KEY_ENV}: set both")
    require = bool(peers.strip())
    if require and not files.ca:
        raise TlsConfigError(
            f"{CA_ENV} is needed to verify client certificates (this service only serves "
            f"the identities {peers!r}); set it, or empty the peers setting"
        )
    certificates = ServerCertificates(files)
    # gRPC takes None from the fetcher as "keep the configuration"; its stubs say otherwise.
    fetch = cast("Callable[[], grpc.ServerCertificateConfiguration]", certificates.fetch)
    return grpc.dynamic_ssl_server_credentials(
        certificates.configuration(), fetch, require_client_authentication=require
    )


def _check_pair(files: TlsFiles) -> None:
    """A certificate and key that do not belong together (or are not PEM) fail gRPC's bind
    with only "Failed to bind to address"; say which files instead."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert, files.key)
    except ssl.SSLError as exc:
        raise TlsConfigError(
            f"{CERT_ENV}={files.cert!r} and {KEY_ENV}={files.key!r} are not a certificate and "
            f"its private key in PEM ({exc.reason or exc}): check that the key is this "
            "certificate's"
        ) from None
    except OSError as exc:  # after SSLError, its subclass: read a moment ago, gone since
        raise TlsConfigError(
            f"cannot read {CERT_ENV}={files.cert!r} or {KEY_ENV}={files.key!r}: "
            f"{exc.strerror or exc}"
        ) from None


def _check_ca(path: str, pem: bytes | None) -> None:
    """A CA file that holds no certificate fails gRPC's bind with "Failed to bind to
    address", or a client's handshake with gRPC core's lines: say which file instead."""
    if pem is None:
        return
    try:
        if not pem.strip():
            raise ValueError("the file is empty")
        ssl.create_default_context(cadata=pem.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise TlsConfigError(
            f"{CA_ENV}={path!r} holds no PEM certificate ({getattr(exc, 'reason', None) or exc})"
        ) from None


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """How to dial one service over TLS: credentials and the name its certificate carries."""

    credentials: grpc.ChannelCredentials
    server_name: str

    def options(self) -> list[tuple[str, Any]]:
        # Check the server's certificate names the service meant, whatever address (an IP,
        # a list of replicas) was dialled.
        return [("grpc.ssl_target_name_override", self.server_name)]


def client_tls(files: TlsFiles, server: str) -> ClientTls | None:
    """Credentials to call `server` (a service name), or None for plaintext."""
    if not files.enabled:
        return None
    if not files.ca:
        raise TlsConfigError(f"{CA_ENV} is needed to verify the {server} service's certificate")
    if bool(files.cert) != bool(files.key):
        raise TlsConfigError(f"{CERT_ENV} and {KEY_ENV} go together: set both, or neither")
    root = files._read(files.ca, CA_ENV)
    _check_ca(files.ca, root)
    check_dates(CA_ENV, files.ca, root)
    if files.cert:
        _check_pair(files)
        check_dates(CERT_ENV, files.cert, files._read(files.cert, CERT_ENV))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=files._read(files.key, KEY_ENV) if files.key else None,
        certificate_chain=files._read(files.cert, CERT_ENV) if files.cert else None,
    )
    return ClientTls(credentials, str(server))


class ClientCertificates:
    """How to dial one service, built again from the files once they change."""

    def __init__(self, files: TlsFiles, server: str, recheck_s: float = TLS_RECHECK_S) -> None:
        self.files = files
        self.server = server
        self.current = client_tls(files, server)
        self._watch = FileWatch([files.cert, files.key, files.ca], recheck_s)

    def renewed(self) -> ClientTls | None:
        """New credentials when the files changed since the last check and make a valid set;
        None otherwise (checked at most every `recheck_s`)."""
        if self.current is None or not self._watch.changed():
            return None
        try:
            if self.files.cert:
                _check_pair(self.files)
            renewed = client_tls(self.files, self.server)
        except TlsConfigError as exc:
            log.warning(
                "TLS files changed but do not make a certificate, its key and a CA; calls "
                "keep the ones in use",
                extra={"server": self.server, "error": str(exc)},
            )
            return None
        self.current = renewed
        return renewed


def aio_channel(
    target: str, tls: ClientTls | None, options: Iterable[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, tls.credentials, options=[*options, *tls.options()])


def channel(
    target: str, tls: ClientTls | None, options: Iterable[tuple[str, Any]] = ()
) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.credentials, options=[*options, *tls.options()])


def operator_tls(server: str, environ: Mapping[str, str] = os.environ) -> ClientTls | None:
    """What a CLI tool or the launcher dials `server` with: the operator's certificate."""
    return client_tls(TlsFiles.from_env(OPERATOR, environ), server)


# -- who may call -------------------------------------------------------------------------


def peer_identities(context: Context) -> set[str]:
    """The DNS names and common name of the client's verified certificate (empty: none)."""
    auth = context.auth_context() or {}
    names = [*auth.get("peer_dns", ()), *auth.get("x509_common_name", ())]
    return {n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names}


def parse_peers(peers: str) -> frozenset[str]:
    return frozenset(p.strip() for p in peers.split(",") if p.strip())


class PeerCheck(RpcWrapper):
    """Serves a method only to a client whose certificate names an allowed identity.

    The handshake has already verified the certificate against the CA; this decides which of
    the CA's certificates may call: a certificate for another role is refused.
    """

    def __init__(self, allowed: frozenset[str], setting: str = PEERS_ENV) -> None:
        self.allowed = allowed
        # An internal service's caller should go through the gateway; the gateway's own
        # refusal can only point at who it serves.
        self.advice = (
            "call through the gateway" if setting == PEERS_ENV else f"{setting} names who may call"
        )

    def permits(self, context: Context) -> bool:
        found = peer_identities(context)
        return bool(found) and (ANY_PEER in self.allowed or bool(found & self.allowed))

    async def refuse(self, context: Context) -> None:
        found = ", ".join(sorted(peer_identities(context))) or "no client certificate"
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"this service serves only {', '.join(sorted(self.allowed))}; the caller's "
            f"certificate names {clip(found)}: {self.advice}",
        )

    def wrap(self, method: str, inner: Behaviour) -> Behaviour:
        async def checked(request: Any, context: Context) -> Any:
            if not self.permits(context):
                await self.refuse(context)
            return await inner(request, context)

        return checked

    def wrap_stream(self, method: str, inner: StreamBehaviour) -> StreamBehaviour:
        async def checked(request: Any, context: Context) -> AsyncIterator[Any]:
            if not self.permits(context):
                await self.refuse(context)
            async for reply in inner(request, context):
                yield reply

        return checked


def peer_check(files: TlsFiles, peers: str, setting: str = PEERS_ENV) -> PeerCheck | None:
    """The check for a service with a certificate and a peers list; None otherwise."""
    allowed = parse_peers(peers)
    return PeerCheck(allowed, setting) if files.cert and allowed else None
