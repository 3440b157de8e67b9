"""`hopline cache stats`: the cache service's GetStats, for an operator at a terminal.

What the cache holds and how its lookups go (entries, hits by tier, lookup latency, pending and
failed writes, verification and each scope's verified rule), read from the cache's own
address (HOPLINE_CACHE_ADDR; over TLS with the operator's certificate where HOPLINE_TLS_CA is
set), as `hopline cache invalidate` reaches it. Before this, the figures were there only for a
gRPC client of one's own, or as Prometheus series. `--json` prints the message itself, its
int64 counts as JSON numbers (protobuf's JSON mapping writes them as strings).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hopline.runtime.service_table import spec

if TYPE_CHECKING:  # the messages are imported when the command runs, not when `hopline` starts
    from google.protobuf.descriptor import FieldDescriptor

    from hopline.protos.hopline.cache.v1 import cache_pb2

TIMEOUT_S = 10.0


def add_stats(cache_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    stats = cache_sub.add_parser(
        "stats",
        help="what the cache holds and how its lookups go (the cache service's GetStats)",
    )
    stats.add_argument("--json", action="store_true", help="the GetStats reply as JSON")
    stats.add_argument(
        "--cache",
        help=f"the cache's address [env HOPLINE_CACHE_ADDR; default {spec('cache').default_addr}]",
    )
    stats.set_defaults(cache_handler=show_stats)


def show_stats(args: argparse.Namespace) -> int:
    import grpc

    from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
    from hopline.runtime.ports import dial_problem
    from hopline.runtime.tls import channel, operator_tls

    address = args.cache if args.cache is not None else spec("cache").address()
    named_by = "--cache" if args.cache is not None else "HOPLINE_CACHE_ADDR"
    if problem := dial_problem(address, named_by):
        sys.stderr.write(f"hopline cache stats: error: {problem}\n")
        return 2
    with channel(address, operator_tls("cache")) as chan:
        try:
            reply = cache_pb2_grpc.CacheServiceStub(chan).GetStats(
                cache_pb2.GetStatsRequest(), timeout=TIMEOUT_S
            )
        except grpc.RpcError as err:
            sys.stderr.write(f"error: {err.code().name}: {err.details()} (cache at {address})\n")
            return 1
    if args.json:
        sys.stdout.write(json.dumps(as_json(reply), indent=2) + "\n")
    else:
        sys.stdout.write("".join(f"{line}\n" for line in report(address, reply)))
    return 0


def as_json(reply: cache_pb2.GetStatsResponse) -> dict[str, Any]:
    """The reply in protobuf's JSON mapping, every field written (a zero count too: `jq
    .store_errors` reads 0, not null), with its int64 counts as JSON numbers: the mapping
    writes 64-bit integers as strings, for JavaScript's doubles, and `--json` printed
    "entries": "3" (an operator's probe). The cache's counts stay far below 2**53."""
    from google.protobuf import json_format

    doc = json_format.MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_as_numbers(reply.DESCRIPTOR.fields, doc)
    return doc


def _int64_as_numbers(fields: Iterable[FieldDescriptor], doc: dict[str, Any]) -> None:
    """`doc`'s int64 fields, and its messages', as numbers (not a map's values: the reply has
    no map of integers)."""
    from google.protobuf.descriptor import FieldDescriptor

    int64 = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
    for field in fields:
        if field.name not in doc:
            continue
        value = doc[field.name]
        if field.cpp_type in int64:
            doc[field.name] = [int(v) for v in value] if field.is_repeated else int(value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if field.is_repeated else [value]:
                if isinstance(item, dict):  # a well-known type is written as a string
                    _int64_as_numbers(field.message_type.fields, item)


def report(address: str, s: cache_pb2.GetStatsResponse) -> list[str]:
    """The figures as lines an operator reads top down: what is held, how lookups go, what
    writes did, then verification."""
    lines = [f"cache at {address}: {s.uri or 'no store'}, collection {s.collection or '-'}"]
    if s.milvus_unreachable:
        lines.append(
            "Milvus is not answering: entries are the exact index's, every other figure is "
            "this process's own"
        )
    lines += [
        f"entries {s.entries} ({s.pending_writes} accepted, not yet written; "
        f"{s.pending_invalidations} invalidations not yet deleted)",
        f"lookups {s.lookups}: exact hits {s.exact_hits}, semantic hits {s.semantic_hits}, "
        f"misses {s.misses}, refused as ambiguous {s.ambiguous}; p50 {s.lookup_p50_ms:.2f} ms, "
        f"p99 {s.lookup_p99_ms:.2f} ms, mean {s.lookup_mean_ms:.2f} ms",
        f"semantic searches from memory {s.memory_searches}, in Milvus {s.milvus_searches}",
        f"stores {s.stores}, dropped by Milvus {s.store_errors}, writes retried "
        f"{s.write_retries}; evicted {s.evictions}, expired {s.expirations}, reclaims "
        f"{s.reclaims}",
        f"verification: candidates {s.verify_candidates}, verified {s.verified}, model "
        f"disagreed {s.disagreements}, answered by the model after the reply "
        f"{s.verified_after_reply}",
    ]
    for rule in s.verify_rules:
        scope = f"{rule.scope.tenant}/{rule.scope.model}/{rule.scope.model_version}"
        source = "learned" if rule.learned else "the model's threshold"
        lines.append(
            f"  rule {scope}: threshold {rule.threshold:.3f} ({source}), "
            f"{rule.observations} observations, {rule.disagreements} disagreements, "
            f"{rule.held_back} answers held back"
        )
    return lines
