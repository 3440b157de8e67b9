"""The semantic cache's similarity threshold, calibrated on labelled pairs.

A pair is a query and the entry a cache would return for it (its nearest neighbour), labelled
same-answer or different-answer. At threshold t a pair is a hit when its cosine is >= t; the
false-hit rate is the share of hits that carry a different answer, the definition the cache's
evaluation uses. `calibrate` picks the lowest threshold whose false-hit rate meets the target
there and at every higher threshold.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import numpy.typing as npt

from hopline.cache.keys import normalise_text

log = logging.getLogger("hopline.cache.calibrate")

Vectors = npt.NDArray[np.float32]
Embed = Callable[[Sequence[str]], Vectors]

# Queries per block of the nearest-neighbour search: bounds the similarity matrix at
# CHUNK x len(store) floats (about 60 MB for 15k store texts).
CHUNK = 1024


class PairsFileError(ValueError):
    """A pairs file that cannot be read."""


class NoThresholdError(ValueError):
    """No threshold keeps the false-hit rate at or under the target."""


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
    store_vectors = embed([text for text, _ in store])
    query_vectors = embed([text for text, _ in semantic])
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
    """Cosines of the pairs under `embed`, each distinct text embedded once."""
    texts = sorted({p.query for p in pairs} | {p.candidate for p in pairs})
    index = {text: i for i, text in enumerate(texts)}
    vectors = embed(texts)
    q = vectors[[index[p.query] for p in pairs]]
    c = vectors[[index[p.candidate] for p in pairs]]
    sims: npt.NDArray[np.float64] = (q * c).sum(axis=1, dtype=np.float64)
    return sims


def write_pairs(pairs: Iterable[Pair], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
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


@dataclass(frozen=True)
class Point:
    """Counts at one threshold; the rates derive from them."""

    threshold: float
    hits: int
    false_hits: int
    pairs: int
    same_pairs: int

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / self.hits if self.hits else 0.0

    @property
    def precision(self) -> float:
        return 1.0 - self.false_hit_rate if self.hits else 1.0

    @property
    def recall(self) -> float:
        return (self.hits - self.false_hits) / self.same_pairs

    @property
    def hit_rate(self) -> float:
        return self.hits / self.pairs


@dataclass(frozen=True, eq=False)
class Curve:
    """The sweep over every observed similarity, highest threshold first."""

    thresholds: npt.NDArray[np.float64]
    hits: npt.NDArray[np.int64]
    false_hits: npt.NDArray[np.int64]
    pairs: int
    same_pairs: int

    @property
    def false_hit_rate(self) -> npt.NDArray[np.float64]:
        return self.false_hits / self.hits

    @property
    def precision(self) -> npt.NDArray[np.float64]:
        return 1.0 - self.false_hit_rate

    @property
    def recall(self) -> npt.NDArray[np.float64]:
        return (self.hits - self.false_hits) / self.same_pairs

    @property
    def hit_rate(self) -> npt.NDArray[np.float64]:
        return self.hits / self.pairs

    def at(self, threshold: float) -> Point:
        """Counts with hits = similarity >= `threshold`, for any threshold."""
        # Thresholds descend; the count of those >= t is the index of the last hit set.
        n = int(np.searchsorted(-self.thresholds, -threshold, side="right"))
        if n == 0:
            return Point(threshold, 0, 0, self.pairs, self.same_pairs)
        return Point(
            threshold,
            int(self.hits[n - 1]),
            int(self.false_hits[n - 1]),
            self.pairs,
            self.same_pairs,
        )


@dataclass(frozen=True, eq=False)
class Calibration(Point):
    target: float
    curve: Curve
    confidence: float = 0.0
    # What was compared with the target at the chosen point: the measured rate, or its
    # upper confidence bound.
    false_hit_bound: float = 0.0


def upper_bound(
    false_hits: npt.NDArray[np.int64], hits: npt.NDArray[np.int64], confidence: float
) -> npt.NDArray[np.float64]:
    """One-sided Wilson upper bound on the false-hit rate at `confidence`: a rate measured
    on a few hundred pairs is noisy, and the threshold that only just meets the target on
    them is the one most likely to miss it on new queries."""
    z = NormalDist().inv_cdf(confidence)
    n = np.maximum(hits, 1).astype(np.float64)
    p = false_hits / n
    centre = p + z * z / (2 * n)
    spread = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    bound: npt.NDArray[np.float64] = (centre + spread) / (1 + z * z / n)
    return bound


def calibrate(
    similarities: npt.ArrayLike,
    same: npt.ArrayLike,
    target: float,
    min_hits: int = 1,
    confidence: float = 0.0,
) -> Calibration:
    """The lowest threshold whose false-hit rate is <= `target` there and above.

    Requiring every higher threshold to meet the target too keeps a dip in a non-monotone
    curve (a run of lucky same-answer pairs) from being picked with a worse region above it.
    Higher thresholds with fewer than `min_hits` hits are not held against a lower one: one
    wrong pair among the first 50 is a 2% rate that says nothing at a 1% target (the CLI uses
    2 / target, two false hits' worth of evidence). The chosen point itself must meet the
    target whatever its count.

    With `confidence` > 0 the rate compared with the target is its one-sided upper
    confidence bound (Wilson) rather than the measured share: the threshold meets the
    target with that confidence, not just on these pairs.
    """
    if min_hits < 1:
        raise ValueError(f"min_hits must be at least 1, got {min_hits}")
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0, 1), got {confidence}")
    s = np.asarray(similarities, dtype=np.float64).ravel()
    y = np.asarray(same, dtype=bool).ravel()
    if not 0.0 < target < 1.0:
        raise ValueError(f"the target false-hit rate must be in (0, 1), got {target}")
    if s.shape != y.shape:
        raise ValueError(f"{s.size} similarities but {y.size} labels")
    if s.size == 0:
        raise ValueError("no pairs to calibrate on")
    if not np.isfinite(s).all():
        raise ValueError("similarities must be finite")
    same_pairs = int(y.sum())
    if same_pairs == 0:
        raise ValueError("no same-answer pairs: recall is undefined and nothing should hit")

    order = np.argsort(-s, kind="stable")
    ranked = s[order]
    wrong = np.cumsum(~y[order], dtype=np.int64)
    # A threshold admits all pairs with equal similarity at once: keep the end of each run.
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    curve = Curve(ranked[ends], ends.astype(np.int64) + 1, wrong[ends], int(s.size), same_pairs)

    rates = (
        upper_bound(curve.false_hits, curve.hits, confidence)
        if confidence > 0
        else curve.false_hit_rate
    )
    counted = np.where(curve.hits >= min_hits, rates, 0.0)
    meets = (np.maximum.accumulate(counted) <= target) & (rates <= target)
    if not meets.any():
        if confidence > 0:
            best = int(np.argmin(rates))
            raise NoThresholdError(
                f"no threshold meets a false-hit rate of {target:g} with {confidence:.0%} "
                f"confidence: the lowest upper bound is {rates[best]:.4f} (threshold "
                f"{curve.thresholds[best]:.4f}, {curve.false_hits[best]} of {curve.hits[best]} "
                "hits wrong); give more pairs, label them by the model (`pairs --model`) or "
                "lower --confidence"
            )
        top = curve.at(float(curve.thresholds[0]))
        raise NoThresholdError(
            f"no threshold meets a false-hit rate of {target:g}: even at the highest "
            f"similarity {top.threshold:.4f}, {top.false_hits} of {top.hits} hits are wrong"
        )
    # With min_hits=1 `meets` is a prefix (highest thresholds); in general take the lowest
    # point that meets both conditions.
    k = int(np.flatnonzero(meets)[-1])
    point = curve.at(float(curve.thresholds[k]))
    log.info(
        "calibrated",
        extra={"threshold": point.threshold, "hits": point.hits, "false_hits": point.false_hits},
    )
    return Calibration(
        **asdict(point),
        target=target,
        curve=curve,
        confidence=confidence,
        false_hit_bound=float(rates[k]),
    )


def to_json(result: Calibration) -> dict[str, Any]:
    c = result.curve
    return {
        "target_false_hit_rate": result.target,
        "confidence": result.confidence,
        "false_hit_rate_bound": result.false_hit_bound,
        "threshold": result.threshold,
        "false_hit_rate": result.false_hit_rate,
        "precision": result.precision,
        "recall": result.recall,
        "hit_rate": result.hit_rate,
        "hits": result.hits,
        "false_hits": result.false_hits,
        "pairs": result.pairs,
        "same_pairs": result.same_pairs,
        "curve": {
            "threshold": c.thresholds.tolist(),
            "hits": c.hits.tolist(),
            "false_hits": c.false_hits.tolist(),
        },
    }


def plot(result: Calibration, path: Path) -> None:
    """Precision, recall and hit rate against the threshold, as a PNG."""
    # Imported here: matplotlib is slow to import and only this offline command needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = result.curve
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(c.thresholds, c.precision, label="precision (1 - false-hit rate)")
    ax.plot(c.thresholds, c.recall, label="recall")
    ax.plot(c.thresholds, c.hit_rate, label="hit rate")
    ax.axhline(
        1.0 - result.target,
        color="grey",
        linestyle=":",
        linewidth=1,
        label=f"precision target {1.0 - result.target:g}",
    )
    ax.axvline(
        result.threshold,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"threshold {result.threshold:.4f}",
    )
    ax.set_xlabel("cosine similarity threshold")
    ax.set_ylabel("share")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(
        f"Semantic cache calibration: target false-hit rate {result.target:g} "
        f"({result.pairs} pairs)"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, format="png")
