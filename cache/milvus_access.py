"""What the cache presents to a Milvus server beyond its address: a token, where the server
authenticates (`common.security.authorizationEnabled`; 'user:password' or an API key), and
TLS, where it encrypts (`common.security.tlsMode` 1: a CA that verifies the server; 2, mutual
TLS: this client's certificate and key too), and the database it keeps its collections in
(where it has one of its own: `hopline cache milvus-user` bounds its privileges to it).
milvus-lite by file takes none of them.

Read at start-up from HOPLINE_CACHE_MILVUS_* (cache/config.py); every file is checked then,
so a wrong path fails the start with the setting's name instead of a connection that times
out. The token is read from a file, as a Kubernetes Secret or a compose secret mounts it, and
is never logged. The files are read again when they change (`reread`, from
cache/milvus_connection.py): a password rotated on the server or a renewed certificate is
taken up without a restart.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from hopline.cache.config import (
    MILVUS_CA_ENV,
    MILVUS_CERT_ENV,
    MILVUS_DB_ENV,
    MILVUS_KEY_ENV,
    MILVUS_TOKEN_ENV,
    CacheConfig,
)
from hopline.cache.milvus_lite import is_local
from hopline.cache.store import CacheSettingError, CacheStoreError
from hopline.observability.logs import has_password, without_passwords

# Milvus's rule for database names (it refuses others only when asked to create one).
DATABASE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# The schemes pymilvus dials a Milvus server by; it takes any other URI for a milvus-lite file
# only where it ends in .db.
SERVER_SCHEMES = ("http", "https", "tcp", "unix")
URI_FORMS = (
    "a milvus-lite database file (a path ending in .db) or a Milvus server's URI "
    "(http://host:port, https://host:port, tcp://host:port or unix:///PATH)"
)


def uri_problem(uri: str) -> str | None:
    """What makes HOPLINE_CACHE_URI unusable, found before anything is made or dialled; None
    when nothing is. Left to pymilvus, `milvus:19530` (no scheme) failed with a long message
    of its own after milvus-lite's log folder `milvus:19530.logs` had been made in the
    working directory, an empty URI as ". is not a milvus-lite database file", and one with a
    space after it as "no Milvus answered within 5s", none of them naming the setting."""
    said = f"HOPLINE_CACHE_URI {uri!r}"
    if not uri.strip():
        return f"HOPLINE_CACHE_URI is empty: set {URI_FORMS}"
    if uri != uri.strip():
        return f"{said} has whitespace around it: remove it"
    if is_local(uri):
        if uri.endswith(".db"):
            return None
        return f"{said} is not a milvus-lite database file nor a URI: set {URI_FORMS}"
    parts = urlsplit(uri)
    if has_password(uri):  # said without it: this message is logged
        shown = without_passwords(uri)
        return (
            f"HOPLINE_CACHE_URI {shown!r} carries a password: put 'user:password' in the file "
            "HOPLINE_CACHE_MILVUS_TOKEN_FILE names (a URI is logged, a token file is not)"
        )
    scheme = parts.scheme.lower()
    if scheme not in SERVER_SCHEMES:
        return f"{said}: a Milvus server's URI starts http://, https://, tcp:// or unix://"
    if scheme == "unix":
        return None if parts.path else f"{said}: unix:///PATH names the server's socket"
    try:
        _ = parts.port  # a port that is no number, or past 65535, raises here
    except ValueError:
        return f"{said}: the port must be a number from 0 to 65535"
    if not parts.hostname:
        return f"{said}: a Milvus server's URI names its host ({scheme}://host:port)"
    return None


def work_dir_problem(work_dir: str) -> str | None:
    """What makes HOPLINE_CACHE_DIR unusable for the embedding encoder, or None. The encoder
    is built there while Milvus loads, so a folder that cannot be made was said, as a bare
    FileNotFoundError or NotADirectoryError, only once the load had finished: minutes on a
    large collection. Only checked: a folder made read-only with the encoder already built
    in it is fine."""
    if not work_dir.strip():  # Path("") is the working folder: the encoder was built there
        return "HOPLINE_CACHE_DIR is empty: give the folder for the built embedding encoder"
    path = Path(work_dir)
    if path.is_dir():
        return None
    if os.path.lexists(path):
        return f"HOPLINE_CACHE_DIR {work_dir!r} is not a folder"
    above = path.absolute().parent
    while not os.path.lexists(above):
        above = above.parent
    if not above.is_dir():
        return f"HOPLINE_CACHE_DIR {work_dir!r} cannot be made: {above} is not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"HOPLINE_CACHE_DIR {work_dir!r} cannot be made: {above} is not writable"
    return None


def home_problem(uri: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """What stops milvus-lite where HOME cannot be written, or None: it keeps its files under
    $HOME/.cache/milvus, and an unwritable HOME (a platform's arbitrary uid with HOME=/)
    failed the start with 'Assert "init_flag_ == true" => Mmap manager has not been init'
    (a deploy probe). A Milvus server's cache writes nothing there."""
    if not is_local(uri):
        return None
    home = environ.get("HOME")
    if not home:  # milvus-lite's server reads it with no fallback and aborts
        return (
            "milvus-lite keeps its files under $HOME/.cache and HOME is not set: set it to a "
            "writable folder"
        )
    path = Path(home) / ".cache" / "milvus"
    while not os.path.lexists(path):
        path = path.parent
    if path.is_dir() and os.access(path, os.W_OK | os.X_OK):
        return None
    return (
        f"milvus-lite keeps its files under $HOME/.cache and HOME={home!r} cannot be written "
        f"there ({path} is not a writable folder): give the cache a writable HOME"
    )


@dataclasses.dataclass(frozen=True)
class MilvusAccess:
    token: str = dataclasses.field(default="", repr=False)
    ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    db_name: str = ""  # empty: the server's default database
    token_file: str = ""  # where `token` was read, to read it again

    @classmethod
    def of(cls, config: CacheConfig) -> MilvusAccess:
        """The settings checked against each other and the URI, the token read; raises
        CacheStoreError with what to change."""
        # The cache's start checks its settings here first: so its encoder's folder, though
        # no Milvus setting, is refused before the store spends a load on a start that fails.
        problem = (
            uri_problem(config.uri) or work_dir_problem(config.work_dir) or home_problem(config.uri)
        )
        if problem:
            raise CacheSettingError(problem)
        named = {
            MILVUS_TOKEN_ENV: config.milvus_token_file,
            MILVUS_CA_ENV: config.milvus_ca,
            MILVUS_CERT_ENV: config.milvus_client_cert,
            MILVUS_KEY_ENV: config.milvus_client_key,
            MILVUS_DB_ENV: config.milvus_db,
        }
        given = [env for env, value in named.items() if value]
        if not given:
            return cls()
        uri = config.uri
        if is_local(uri):
            raise CacheStoreError(
                f"{', '.join(given)} set, but HOPLINE_CACHE_URI {uri!r} is a milvus-lite file, "
                "which takes no token, TLS or database: unset them, or give a Milvus server's URI"
            )
        if config.milvus_db and not DATABASE_NAME.fullmatch(config.milvus_db):
            raise CacheStoreError(
                f"{MILVUS_DB_ENV} {config.milvus_db!r}: Milvus takes a letter or underscore, "
                "then letters, digits and underscores, 64 at most"
            )
        tls = [env for env in given if env not in (MILVUS_TOKEN_ENV, MILVUS_DB_ENV)]
        if tls and not uri.startswith("https://"):
            raise CacheStoreError(
                f"{', '.join(tls)} set, but HOPLINE_CACHE_URI {uri!r} does not start with "
                "https://: TLS to Milvus needs an https:// URI"
            )
        if bool(config.milvus_client_cert) != bool(config.milvus_client_key):
            raise CacheStoreError(
                f"{MILVUS_CERT_ENV} and {MILVUS_KEY_ENV} go together: set both, or neither"
            )
        if config.milvus_client_cert and not config.milvus_ca:
            raise CacheStoreError(
                f"{MILVUS_CERT_ENV} needs {MILVUS_CA_ENV}: "
                "mutual TLS verifies the server by that CA"
            )
        return cls(
            "",
            config.milvus_ca,
            config.milvus_client_cert,
            config.milvus_client_key,
            config.milvus_db,
            config.milvus_token_file,
        ).reread()

    @property
    def files(self) -> tuple[str, ...]:
        """The files this access is read from (none for milvus-lite)."""
        return tuple(f for f in (self.token_file, self.ca, self.client_cert, self.client_key) if f)

    def reread(self) -> MilvusAccess:
        """The same settings with the token read again and the TLS files checked again;
        raises CacheStoreError naming the setting whose file cannot be used."""
        for path, env in (
            (self.ca, MILVUS_CA_ENV),
            (self.client_cert, MILVUS_CERT_ENV),
            (self.client_key, MILVUS_KEY_ENV),
        ):
            if path:
                _readable(path, env)
        token = ""
        if self.token_file:
            token = _readable(self.token_file, MILVUS_TOKEN_ENV).strip()
            if not token:
                raise CacheSettingError(f"{MILVUS_TOKEN_ENV} {self.token_file!r} is empty")
        return dataclasses.replace(self, token=token)

    def client_kwargs(self) -> dict[str, str]:
        """pymilvus.MilvusClient's keywords for this access (an https:// URI turns TLS on).

        Pass `dedicated=True` beside them: pymilvus shares one connection among the clients
        of a process with the same address and token, whatever their TLS settings or scheme,
        so a client after the first would silently ride the first one's channel."""
        kwargs: dict[str, str] = {}
        if self.token:
            kwargs["token"] = self.token
        if self.db_name:
            kwargs["db_name"] = self.db_name
        if self.client_cert:
            # pymilvus sends a client certificate only on this path, with the CA beside it.
            kwargs |= {
                "ca_pem_path": self.ca,
                "client_pem_path": self.client_cert,
                "client_key_path": self.client_key,
            }
        elif self.ca:
            kwargs["server_pem_path"] = self.ca  # the root that verifies the server
        return kwargs

    def refusal_hint(self, uri: str) -> str:
        """What a server that does not take the connection may want, for the start-up error."""
        token = (
            f"refused the token in {MILVUS_TOKEN_ENV}"
            if self.token
            else f"wants a token ({MILVUS_TOKEN_ENV})"
        )
        tls = (
            f"refused this client's TLS ({MILVUS_CA_ENV}, {MILVUS_CERT_ENV})"
            if uri.startswith("https://")
            else f"wants TLS (an https:// URI and {MILVUS_CA_ENV})"
        )
        return f"or it {token}, or it {tls}"


NO_ACCESS = MilvusAccess()  # milvus-lite, or a server that asks for nothing


def _readable(path: str, env: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CacheSettingError(f"cannot read {env} {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CacheSettingError(f"{env} {path!r} is not text (PEM, or a token)") from None
