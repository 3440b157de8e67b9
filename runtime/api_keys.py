"""API keys: `HOPLINE_API_KEYS` names a JSON file of key -> tenant.

The gateway reads it to name each caller's tenant (gateway/identity.py); the launcher reads
it to send a key with its own GetStats (`operator_metadata`), as it dials with the operator's
certificate for TLS (runtime/tls.py:operator_tls). hopline's client tools (`hopline predict`,
`hopline bench`) send a caller's own key instead: `--api-key`, else `HOPLINE_API_KEY`
(`caller_metadata`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

API_KEYS_ENV = "HOPLINE_API_KEYS"
# One caller's key (the client tools'), not the gateway's file of them.
API_KEY_ENV = "HOPLINE_API_KEY"
AUTHORIZATION = "authorization"


TENANT_MAX_CHARS = 128
# The cache's scope columns hold 256 bytes (cache/milvus_rows.py:SCOPE_NAME_MAX): a longer
# tenant would be served but never stored.
TENANT_MAX_BYTES = 256
TENANT_RULE = (
    f"1-{TENANT_MAX_CHARS} printable characters, at most {TENANT_MAX_BYTES} bytes in UTF-8"
)


def valid_tenant(tenant: str) -> bool:
    return (
        0 < len(tenant) <= TENANT_MAX_CHARS
        and tenant.isprintable()
        and len(tenant.encode("utf-8")) <= TENANT_MAX_BYTES
    )


def _key_problem(key: object, tenant: object) -> str | None:
    """Why one entry of a keys file cannot work; never the key itself (a secret)."""
    if not isinstance(key, str) or not key:
        return "a key must be a non-empty string"
    if not isinstance(tenant, str) or not valid_tenant(tenant):
        return f"the tenant of a key must be a string of {TENANT_RULE}"
    if not sendable_key(key):
        return f"the key of tenant {tenant!r} must be {KEY_RULE}"
    return None


class UnsendableKey(ValueError):
    """A caller's key that no header can carry."""


KEY_RULE = "printable ASCII with no spaces around it (it is sent as 'authorization: Bearer <key>')"


def sendable_key(key: str) -> bool:
    """A key travels in an HTTP/2 header: a character a header cannot carry, or spaces around
    it that the gateway strips, make a key no caller can use."""
    return key.isascii() and key.isprintable() and key == key.strip()


class _RepeatedKey(ValueError):
    pass


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are each said once: json's own rule, the last wins, would
    hand a key listed for two tenants to whichever comes last, without a word."""
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise _RepeatedKey(
                f"a key is listed twice (for {seen[name]!r} and {value!r}): a key names "
                "one tenant; remove one of them"
            )
        seen[name] = value
    return seen


def load_api_keys(keys_file: str) -> dict[str, str]:
    """The file's key -> tenant map; ValueError, saying what is wrong, for anything else."""
    try:
        raw = json.loads(Path(keys_file).read_text(encoding="utf-8"), object_pairs_hook=_once)
    except _RepeatedKey as exc:
        raise ValueError(f"{keys_file}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read API keys from {keys_file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{keys_file} must be a JSON object of key -> tenant strings")
    if not raw:
        raise ValueError(
            f"{keys_file} names no API keys: with {API_KEYS_ENV} set, every request "
            "needs a key, so an empty file would lock everyone out"
        )
    for key, tenant in raw.items():
        problem = _key_problem(key, tenant)
        if problem is not None:
            raise ValueError(f"{keys_file}: {problem}")
    keys: dict[str, str] = raw
    return keys


def bearer(key: str) -> tuple[str, str]:
    return AUTHORIZATION, f"Bearer {key}"


def operator_metadata(environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """What the operator's own calls to the gateway carry: with API keys configured, the
    first key of the file (any key answers an operator's call: none of them is about one
    tenant's data); nothing without keys."""
    keys_file = environ.get(API_KEYS_ENV, "")
    if not keys_file:
        return ()
    return (bearer(next(iter(load_api_keys(keys_file)))),)


def caller_metadata(
    key: str | None = None, environ: Mapping[str, str] = os.environ
) -> tuple[tuple[str, str], ...]:
    """What a client tool sends as its caller: `key` (its `--api-key`) where given, else
    `HOPLINE_API_KEY`, else nothing (a gateway without API keys needs none). The key names
    the caller's tenant at the gateway. UnsendableKey, naming where the key came from, for one
    no header can carry."""
    chosen = (environ.get(API_KEY_ENV, "") if key is None else key).strip()
    if chosen and not sendable_key(chosen):
        # Refused here, not by gRPC's core as an INTERNAL "Illegal header value".
        where = API_KEY_ENV if key is None else "--api-key"
        raise UnsendableKey(f"{where}: an API key must be {KEY_RULE}")
    return (bearer(chosen),) if chosen else ()
