"""Which tenant a request belongs to.

With API keys configured (HOPLINE_API_KEYS: a JSON file mapping key -> tenant) the tenant is
the key's, from `authorization: Bearer <key>` metadata, and a request naming another tenant
is refused. Without keys the mesh trusts its callers: `x-hopline-tenant` metadata, then the
request's tenant field, then "default". Either metadata key sent twice is refused, never "the
last wins" (a proxy appending its own would otherwise decide). The tenant is part of every
cache key and filter, so getting it from an authenticated identity is what keeps tenants apart.

The keys file is re-read when it changes (checked at most every KEYS_RECHECK_S, from
requests): a revoked key is refused and a new one served without a restart, as when a
Kubernetes Secret volume is updated in place. A file that no longer reads as keys (half
written, emptied, removed) leaves the keys in force, with a warning: a bad edit never locks
every tenant out, nor lets a revoked key back in.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from hopline.gateway.errors import abort
from hopline.runtime.api_keys import (
    API_KEYS_ENV,
    AUTHORIZATION,
    TENANT_RULE,
    load_api_keys,
    valid_tenant,
)
from hopline.runtime.config import SettingError
from hopline.runtime.errors import StatusError, clip
from hopline.runtime.file_watch import FileWatch
from hopline.runtime.interceptors import Behaviour, Context, RpcWrapper

TENANT_METADATA = "x-hopline-tenant"
DEFAULT_TENANT = "default"
KEYS_RECHECK_S = 2.0  # how often the keys file's identity (inode, size, mtime) is compared

log = logging.getLogger("hopline.gateway.identity")


class IdentityError(StatusError):
    """No API key, an unknown one, or a tenant the key does not belong to."""


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _digests(raw: Mapping[str, str]) -> dict[str, str]:
    # Keyed by digest: the lookup compares fixed-length hashes, not the secrets.
    return {_digest(k): v for k, v in raw.items()}


class TenantResolver:
    def __init__(self, keys_file: str = "", recheck_s: float = KEYS_RECHECK_S) -> None:
        self.keys_file = keys_file
        self.keys: dict[str, str] = {}
        self._watch = FileWatch([keys_file], recheck_s)
        if keys_file:
            try:
                self.keys = _digests(load_api_keys(keys_file))
            except ValueError as exc:  # a setting that cannot work: do not start
                raise SettingError(f"invalid {API_KEYS_ENV}: {exc}") from exc

    def _reread_if_changed(self) -> None:
        """The keys file again, when it changed since it was last read (module docstring)."""
        if not self._watch.changed():
            return  # a bad file is reported once, and read again once it changes
        try:
            keys = _digests(load_api_keys(self.keys_file))
        except ValueError as exc:
            log.warning(
                "API keys file changed but cannot be used; the keys read before stay in force",
                extra={"error": str(exc)},
            )
            return
        added, revoked = len(keys.keys() - self.keys.keys()), len(self.keys.keys() - keys.keys())
        self.keys = keys
        log.info("API keys re-read", extra={"keys": len(keys), "added": added, "revoked": revoked})

    def require_key(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """With API keys configured, refuse a caller without a valid one (UNAUTHENTICATED):
        for what is not a prediction but still tells about the gateway (its counters, its
        models' tensors and configs). Health and readiness stay open to probes."""
        if self.keys:
            self.resolve("", metadata)

    def resolve(self, field: str, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        sent, auth = "", ""
        sents = auths = 0
        for key, value in metadata:
            if key == TENANT_METADATA:
                sent, sents = _text(value), sents + 1
            elif key == AUTHORIZATION:
                auth, auths = _text(value), auths + 1
        # Twice is ambiguous, not "the last wins": a proxy that appends its own header must
        # not turn a refused claim into an accepted one.
        if auths > 1:
            raise IdentityError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"send one 'authorization' metadata entry, not {auths}",
            )
        if sents > 1:
            raise IdentityError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"send one '{TENANT_METADATA}' metadata entry, not {sents}",
            )
        if self.keys_file:
            self._reread_if_changed()
        if self.keys:
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                if scheme.lower() == "bearer":
                    wrong = "empty"  # 'Bearer ' and nothing after it
                else:
                    wrong = "sent without 'Bearer '" if auth.strip() else "needed"
                raise IdentityError(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"this gateway's API key is {wrong}: send metadata "
                    "'authorization: Bearer <key>'",
                )
            tenant = self.keys.get(_digest(token.strip()))
            if tenant is None:
                raise IdentityError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
            for claimed in (sent, field):  # both, where both name one
                if claimed and claimed != tenant:
                    raise IdentityError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"this API key belongs to tenant {clip(tenant)!r}, not {clip(claimed)!r}",
                    )
            return tenant
        tenant = sent or field or DEFAULT_TENANT
        if not valid_tenant(tenant):
            raise IdentityError(grpc.StatusCode.INVALID_ARGUMENT, f"tenant must be {TENANT_RULE}")
        return tenant


# The unary methods that serve only a caller with a valid key (PredictStream checks its
# caller before it reads a message; the probes and ServerMetadata stay open).
KEYED_METHODS = frozenset(
    {
        "/hopline.gateway.v1.GatewayService/Predict",
        "/hopline.gateway.v1.GatewayService/GetStats",
        "/inference.GRPCInferenceService/ModelInfer",
        "/inference.GRPCInferenceService/ModelMetadata",
        "/inference.GRPCInferenceService/ModelConfig",
    }
)


class KeyFirst(RpcWrapper):
    """With API keys, a keyed method refuses a caller without a valid key before its request
    is parsed: a caller without one learns nothing about its request, not even that its bytes
    do not parse (that was INVALID_ARGUMENT before UNAUTHENTICATED). The method checks the
    key again, with the tenant it claims."""

    def __init__(self, tenants: TenantResolver) -> None:
        self.tenants = tenants

    def wrap(self, method: str, inner: Behaviour) -> Behaviour | None:
        # Without a keys file there never are keys: no layer on every call.
        if method not in KEYED_METHODS or not self.tenants.keys_file:
            return None

        async def keyed(request: Any, context: Context) -> Any:
            try:
                self.tenants.require_key(context.invocation_metadata() or ())
            except IdentityError as err:
                await abort(context, err)
            return await inner(request, context)

        return keyed
