"""`hopline cache invalidate`: an operator's Invalidate, from the command line.

The cache service takes it on its own address (HOPLINE_CACHE_ADDR, where operators reach it;
over TLS with the operator's certificate where HOPLINE_TLS_CA is set), removes the entries
from every tier and tells every gateway's watch, as any Invalidate call does. Before this an
operator had to write a gRPC client to drop a tenant's or a model version's answers.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from hopline.runtime.service_table import spec

if TYPE_CHECKING:  # the messages are imported when the command runs, not when `hopline` starts
    from hopline.protos.hopline.cache.v1 import cache_pb2

TIMEOUT_S = 30.0  # a scope's delete in Milvus: seconds for a large tenant


def add_invalidate(cache_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inv = cache_sub.add_parser(
        "invalidate",
        help="drop cached answers: a tenant's, a model's or a model version's, or entries by "
        "id, from the cache and every gateway's local copy",
    )
    inv.add_argument("--tenant", default="", help="every entry of this tenant")
    inv.add_argument("--model", default="", help="every entry of this model (with --tenant: its)")
    inv.add_argument("--model-version", default="", help="only this version (needs --model)")
    inv.add_argument(
        "--id",
        dest="ids",
        action="append",
        default=[],
        help="an entry id (PredictResponse.cache.entry_id; 64 hex digits); repeat for more",
    )
    inv.add_argument(
        "--cache",
        help=f"the cache's address [env HOPLINE_CACHE_ADDR; default {spec('cache').default_addr}]",
    )
    inv.set_defaults(cache_handler=invalidate)


def request_of(args: argparse.Namespace) -> cache_pb2.InvalidateRequest | str:
    """The Invalidate the flags ask for, or what is wrong with them (a usage mistake)."""
    from hopline.model.repository import is_version
    from hopline.protos.hopline.cache.v1 import cache_pb2
    from hopline.protos.hopline.common.v1 import common_pb2

    if args.ids and (args.tenant or args.model):
        # Both go (the RPC deletes the ids and the scope): `--id X --tenant T` read as "X,
        # of T" and dropped all of T's entries (an operator's probe, exit 0).
        return (
            "--id names entries by themselves: give --id alone, or --tenant/--model "
            "without --id (both would drop the whole scope as well)"
        )
    if args.model_version and not args.model:
        return "--model-version needs --model"
    if args.model_version and not is_version(args.model_version):
        return (
            "--model-version is a version number, a positive integer as the model "
            f"repository's folders are named (1, 2, ...), got {args.model_version!r}"
        )
    request = cache_pb2.InvalidateRequest(entry_ids=args.ids)
    if args.tenant or args.model:
        request.scope.CopyFrom(
            common_pb2.Scope(tenant=args.tenant, model=args.model, model_version=args.model_version)
        )
    elif not args.ids:
        return "name what goes: --tenant, --model or --id"
    return request


def invalidate(args: argparse.Namespace) -> int:
    import grpc

    from hopline.protos.hopline.cache.v1 import cache_pb2_grpc
    from hopline.runtime.ports import dial_problem
    from hopline.runtime.tls import channel, operator_tls

    request = request_of(args)
    if isinstance(request, str):
        sys.stderr.write(f"hopline cache invalidate: error: {request}\n")
        return 2
    address = args.cache if args.cache is not None else spec("cache").address()
    named_by = "--cache" if args.cache is not None else "HOPLINE_CACHE_ADDR"
    if problem := dial_problem(address, named_by):
        sys.stderr.write(f"hopline cache invalidate: error: {problem}\n")
        return 2
    with channel(address, operator_tls("cache")) as chan:
        try:
            reply = cache_pb2_grpc.CacheServiceStub(chan).Invalidate(request, timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            sys.stderr.write(f"error: {err.code().name}: {err.details()} (cache at {address})\n")
            return 1
    sys.stdout.write(f"invalidated: {reply.removed} entries removed from Milvus\n")
    return 0
