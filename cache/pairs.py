"""Labelled pairs for calibrating the semantic cache: each query with the entry a cache warmed
with the store texts would return for it (its nearest neighbour), same-answer or not.

Texts are embedded as the cache service embeds them: `normalise_text(text)`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from hopline.cache.keys import normalise_text

log = logging.getLogger("hopline.cache.pairs")

Vectors = npt.NDArray[np.float32]
Embed = Callable[[Sequence[str]], Vectors]

# Queries per block of the nearest-neighbour search: bounds the similarity matrix at
# CHUNK x len(store) floats (about 60 MB for 15k store texts).
CHUNK = 1024


class PairsFileError(ValueError):
    """A pairs file that cannot be read."""


@dataclass(frozen=True)
class Pair:
    query: str
    candidate: str
    same: bool
    query_label: str
    candidate_label: str
    # The cosine under the embedder that derived the pair; absent in hand-made files.
    similarity: float | None = None


def derive_pairs(
    embed: Embed,
    store: Sequence[tuple[str, str]],
    queries: Sequence[tuple[str, str]],
    oos_label: str = "oos",
) -> list[Pair]:
    """Each query paired with its nearest store text: what a cache warmed with `store` returns.

    An out-of-scope query has no right answer in the store, so its pair is never same-answer.
    A query whose normalised text is in the store is left out: the exact tier answers it
    whatever the threshold, so it says nothing about the threshold (and a data set's
    conflicting labels on one text would otherwise set a floor under the false-hit rate).
    Every text is embedded as `normalise_text(text)`, exactly what the cache service embeds
    (cache/service.py embeds the normalised text on lookup and store), so the cosines are the
    ones the service compares with its threshold.
    """
    stored = {normalise_text(text) for text, _ in store}
    semantic = [q for q in queries if normalise_text(q[0]) not in stored]
    if not store or not semantic:
        raise ValueError("need at least one store text and one query the exact tier misses")
    log.info(
        "embedding",
        extra={
            "store": len(store),
            "queries": len(semantic),
            "exact_repeats": len(queries) - len(semantic),
        },
    )
    store_vectors = embed([normalise_text(text) for text, _ in store])
    query_vectors = embed([normalise_text(text) for text, _ in semantic])
    pairs: list[Pair] = []
    for start in range(0, len(semantic), CHUNK):
        block = semantic[start : start + CHUNK]
        # Unit-length vectors: the dot product is the cosine.
        sims = query_vectors[start : start + CHUNK] @ store_vectors.T
        best = np.argmax(sims, axis=1)
        for row, (index, (text, label)) in enumerate(zip(best, block, strict=True)):
            candidate, candidate_label = store[int(index)]
            pairs.append(
                Pair(
                    query=text,
                    candidate=candidate,
                    same=label == candidate_label and label != oos_label,
                    query_label=label,
                    candidate_label=candidate_label,
                    similarity=float(sims[row, index]),
                )
            )
    return pairs


def pair_similarities(embed: Embed, pairs: Sequence[Pair]) -> npt.NDArray[np.float64]:
    """Cosines of the pairs under `embed`, each distinct normalised text embedded once (the
    text the cache service embeds, `normalise_text`)."""
    texts = sorted({normalise_text(t) for p in pairs for t in (p.query, p.candidate)})
    index = {text: i for i, text in enumerate(texts)}
    vectors = embed(texts)
    q = vectors[[index[normalise_text(p.query)] for p in pairs]]
    c = vectors[[index[normalise_text(p.candidate)] for p in pairs]]
    sims: npt.NDArray[np.float64] = (q * c).sum(axis=1, dtype=np.float64)
    return sims


def write_pairs(pairs: Iterable[Pair], path: Path) -> None:
    """Whole or not at all: written beside `path`, then renamed over it. Written in place, a
    full disk left 90 lines ending mid-record as if complete, over the earlier good file
    (an operator's probe). In place where that cannot be done: a target that is no regular
    file (/dev/stdout, a pipe) or a folder this process may not add a file to; a link's
    target is what is replaced, not the link."""
    target = path.resolve()
    if (target.exists() and not target.is_file()) or not os.access(target.parent, os.W_OK):
        with path.open("w", encoding="utf-8") as f:
            _write_rows(pairs, f)
        return
    staging = target.with_name(f".{target.name}.partial")
    try:
        with staging.open("w", encoding="utf-8") as f:
            _write_rows(pairs, f)
        staging.replace(target)
    except BaseException as exc:
        staging.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"writing the pairs to {path} failed: {exc.strerror}") from exc
        raise


def _write_rows(pairs: Iterable[Pair], f: TextIO) -> None:
    for p in pairs:
        row = {k: v for k, v in asdict(p).items() if v is not None}
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_pairs(path: Path) -> list[Pair]:
    pairs: list[Pair] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row: Any = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PairsFileError(f"{path}:{n}: not JSON: {exc}") from exc
            pairs.append(_pair(row, f"{path}:{n}"))
    if not pairs:
        raise PairsFileError(f"{path}: no pairs")
    return pairs


def _pair(row: Any, where: str) -> Pair:
    if not isinstance(row, dict):
        raise PairsFileError(f"{where}: expected an object")
    strings = ("query", "candidate", "query_label", "candidate_label")
    if not all(isinstance(row.get(k), str) for k in strings) or not isinstance(
        row.get("same"), bool
    ):
        raise PairsFileError(f"{where}: needs strings {', '.join(strings)} and a boolean same")
    sim = row.get("similarity")
    # bool is an int: reject it explicitly so `true` is not read as a cosine of 1.
    if sim is not None and (isinstance(sim, bool) or not isinstance(sim, int | float)):
        raise PairsFileError(f"{where}: similarity must be a number")
    return Pair(
        row["query"],
        row["candidate"],
        row["same"],
        row["query_label"],
        row["candidate_label"],
        None if sim is None else float(sim),
    )
