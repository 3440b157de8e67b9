"""A Milvus user for the cache with the privileges its work takes and none of an
administrator's: `hopline cache milvus-user`, run once by an operator (or a deployment's Job)
with an administrator's token, before the cache's first start on that server.

The cache then connects with its own `user:password` (HOPLINE_CACHE_MILVUS_TOKEN_FILE), not
root's: a cache pod that is broken into cannot manage users, roles or databases, nor read the
root password. Milvus grants privileges per collection name or for every collection (`*`):
the cache makes its collections' names from its models (cache/generations.py), so it is given
every collection of the database it connects to. With HOPLINE_CACHE_MILVUS_DB that is a
database of its own, made here where missing, and nothing outside it: other databases'
collections are neither readable nor writable to it, nor can it make collections there. Run
against Milvus 2.3.5 (tests/deploy/test_cache_milvus_security.py), where every user may also
describe and list collections.
"""

from __future__ import annotations

import enum
import logging
import re
from typing import Any

from hopline.cache.config import MILVUS_TOKEN_ENV, CacheConfig
from hopline.cache.milvus_access import MilvusAccess
from hopline.cache.store import CacheStoreError

ROLE = "hopline_cache"
EVERY_COLLECTION = "*"
# Milvus's rule for user names (it refuses others only when asked to create one).
USER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")


class Grant(enum.StrEnum):
    """Milvus's object types a privilege is granted on."""

    GLOBAL = "Global"
    COLLECTION = "Collection"


# What the cache does to Milvus, found by running it as a user with none and adding what
# each refusal named (store, overwrite, restart and rebuild, lookup, invalidate, the shared
# invalidation log), then what its other paths call.
PRIVILEGES: tuple[tuple[Grant, str], ...] = (
    (Grant.GLOBAL, "CreateCollection"),  # its collection, invalidation log, evidence: first start
    (Grant.GLOBAL, "DropCollection"),  # the copy an unfinished reclaim left (generations.py)
    (Grant.COLLECTION, "CreateIndex"),
    (Grant.COLLECTION, "Load"),
    (Grant.COLLECTION, "Insert"),
    (Grant.COLLECTION, "Upsert"),
    (Grant.COLLECTION, "Delete"),  # invalidations, expired and evicted entries
    (Grant.COLLECTION, "Query"),  # exact reads, the index's rebuild, the invalidation log
    (Grant.COLLECTION, "Search"),  # semantic lookups on a Milvus server
)


def user_and_password(token: str) -> tuple[str, str]:
    user, sep, password = token.partition(":")
    if not sep or not user or not password:
        raise CacheStoreError(
            f"{MILVUS_TOKEN_ENV} must hold 'user:password' for the user to make "
            "(an API key names no user)"
        )
    if not USER_NAME.fullmatch(user):
        raise CacheStoreError(
            f"{MILVUS_TOKEN_ENV}'s user {user!r}: Milvus takes a letter, then letters, digits "
            "and underscores, 32 at most"
        )
    return user, password


def ensure_cache_user(client: Any, token: str, db_name: str = "") -> list[str]:
    """The cache's database (`db_name`; empty: the server's default), its role with
    PRIVILEGES there and its user in that role, each made where missing; what was done, as
    lines. An existing user's password is left as it is (Milvus changes a password only given
    the old one)."""
    user, password = user_and_password(token)
    done = []
    if db_name:
        if db_name in client.list_databases():
            done.append(f"database {db_name} exists")
        else:
            client.create_database(db_name)
            done.append(f"database {db_name} created")
    if ROLE not in client.list_roles():
        client.create_role(ROLE)
        done.append(f"role {ROLE} created")
    for grant, privilege in PRIVILEGES:
        client.grant_privilege(ROLE, grant.value, privilege, EVERY_COLLECTION, db_name=db_name)
    where = f"database {db_name}" if db_name else "the default database"
    done.append(f"role {ROLE} granted {', '.join(p for _, p in PRIVILEGES)} in {where}")
    if user in client.list_users():
        done.append(f"user {user} exists: its password is left as it is")
    else:
        client.create_user(user, password)
        done.append(f"user {user} created")
    client.grant_role(user, ROLE)
    done.append(f"user {user} in role {ROLE}")
    return done


def admin_client(config: CacheConfig, access: MilvusAccess, admin_token: str) -> Any:
    """A client of the cache's Milvus (its URI and TLS settings, `access`) with an
    administrator's token instead of the cache's."""
    from hopline.cache.milvus_store import quiet_pymilvus

    pymilvus = quiet_pymilvus()
    # pymilvus logs every refused call with its traceback; the caller says it in one line.
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    if not admin_token:
        raise CacheStoreError("the administrator's token file is empty")
    if not access.token:
        raise CacheStoreError(f"set {MILVUS_TOKEN_ENV}: the file with the cache's user:password")
    # In the default database: the cache's own may not exist yet (ensure_cache_user makes it).
    kwargs = {**access.client_kwargs(), "token": admin_token}
    kwargs.pop("db_name", None)
    try:
        return pymilvus.MilvusClient(
            config.uri, timeout=config.milvus_timeout_s, dedicated=True, **kwargs
        )
    except Exception as exc:  # pymilvus raises many kinds here
        raise CacheStoreError(
            f"cannot open Milvus at {config.uri} with the administrator's token: {exc}"
        ) from exc
