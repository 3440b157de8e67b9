"""Which of a semantic search's candidates answers a lookup: the rule, apart from the service.

A candidate takes part only if it is in the lookup's scope, live, and its unseen parts (what
the encoder could not see: characters under [UNK], a truncated tail; model/tokenizer.py:
unseen) equal the query's: texts that differ only there embed identically, so their
similarity says nothing about them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hopline.cache.store import Entry, Scope
from hopline.protos.hopline.common.v1 import common_pb2

Unseen = Callable[[str], tuple[str, ...]]  # a normalised text's unseen parts (tokenizes it)


@dataclass
class Verdict:
    hit: tuple[Entry, float] | None = None
    unseen_mismatches: int = 0  # candidates passed over for other unseen parts
    ambiguous: bool = False  # refused: a runner-up close to the best carries another answer


def accept(
    found: Sequence[tuple[Entry, float]],
    scope: Scope,
    now: float,
    threshold: float,
    margin: float,
    query: str,
    unseen: Unseen,
) -> Verdict:
    """The nearest candidate at or above `threshold`, unless one within `margin` below it
    carries another answer: the query sits between two answers, and guessing is a false hit.

    `found` is nearest first, so the walk stops at the first candidate that cannot change the
    answer, before tokenizing it: a miss below the threshold, the usual case, tokenizes
    nothing (the service's event loop tokenized the query and its nearest candidate at every
    such miss before).
    """
    verdict = Verdict()
    best: tuple[Entry, float, str] | None = None
    query_unseen: tuple[str, ...] | None = None
    for candidate, similarity in found:
        # The search was scoped already; checking again costs nothing and keeps a filter
        # mistake from ever crossing tenants.
        if candidate.scope != scope or candidate.expires_at <= now:
            continue
        if best is None and similarity < threshold:
            return verdict  # this one and every one after it are below the threshold
        if best is not None and similarity < threshold - margin:
            break  # too far below to make the best ambiguous, and so is every one after it
        if query_unseen is None:
            query_unseen = unseen(query)
        if unseen(candidate.text) != query_unseen:
            verdict.unseen_mismatches += 1
            continue
        label = common_pb2.Prediction.FromString(candidate.response).label
        if best is None:
            best = (candidate, similarity, label)
        elif label != best[2]:
            verdict.ambiguous = True
            return verdict
    if best is not None:
        verdict.hit = (best[0], best[1])
    return verdict


def eligible(
    found: Sequence[tuple[Entry, float]],
    scope: Scope,
    now: float,
    query: str,
    unseen: Unseen,
) -> tuple[list[tuple[Entry, float, str]], int]:
    """Every candidate that takes part, nearest first, with its answer (a verified-hit rule
    weighs them all), and how many were passed over for other unseen parts."""
    out: list[tuple[Entry, float, str]] = []
    mismatches = 0
    query_unseen: tuple[str, ...] | None = None
    for candidate, similarity in found:
        if candidate.scope != scope or candidate.expires_at <= now:
            continue
        if query_unseen is None:
            query_unseen = unseen(query)
        if unseen(candidate.text) != query_unseen:
            mismatches += 1
            continue
        label = common_pb2.Prediction.FromString(candidate.response).label
        out.append((candidate, similarity, label))
    return out, mismatches
