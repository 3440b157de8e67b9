"""The semantic cache's similarity threshold, calibrated on labelled pairs.

A pair is a query and the entry a cache would return for it (its nearest neighbour), labelled
same-answer or different-answer. At threshold t a pair is a hit when its cosine is >= t; the
false-hit rate is the share of hits that carry a different answer, the definition the cache's
evaluation uses. `calibrate` picks the lowest threshold whose false-hit rate meets the target
there and at every higher threshold, with at least `min_hits` hits under it.
The same rule out of sample is cache/cross_validation.py's; what `hopline cache calibrate`
decides from both, cache/checked_calibration.py's.

Texts are embedded as the cache service embeds them: `normalise_text(text)`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

log = logging.getLogger("hopline.cache.calibrate")


class NoThresholdError(ValueError):
    """No threshold keeps the false-hit rate at or under the target with enough hits.

    `curve` is the sweep it was looked for on (for the plot and the JSON), and
    `pairs_needed` the pair count at which the evidence rule would pick one at the observed
    rates (`pairs_needed()`), or None where more pairs at these rates would not help.
    """

    def __init__(
        self, message: str, curve: Curve | None = None, pairs_needed: int | None = None
    ) -> None:
        super().__init__(message)
        self.curve = curve
        self.pairs_needed = pairs_needed


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

    @property
    def next_lower(self) -> float | None:
        """The highest observed similarity below the threshold: the first pair it keeps out."""
        lower = self.curve.thresholds[self.curve.thresholds < self.threshold]
        return float(lower[0]) if lower.size else None


def default_min_hits(target: float) -> int:
    """The evidence rule's hit count: two false hits' worth at the target rate (2 / target).
    A threshold resting on fewer hits cannot tell the target from twice the target."""
    return math.ceil(2 / target) if 0.0 < target < 1.0 else 1


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


def sweep(similarities: npt.ArrayLike, same: npt.ArrayLike) -> Curve:
    """Hits and false hits at every observed similarity, highest first."""
    s = np.asarray(similarities, dtype=np.float64).ravel()
    y = np.asarray(same, dtype=bool).ravel()
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
    return Curve(ranked[ends], ends.astype(np.int64) + 1, wrong[ends], int(s.size), same_pairs)


def _rates(curve: Curve, confidence: float) -> npt.NDArray[np.float64]:
    """What the rule compares with the target at each threshold."""
    if confidence > 0:
        return upper_bound(curve.false_hits, curve.hits, confidence)
    return curve.false_hit_rate


def pairs_needed(curve: Curve, target: float, min_hits: int, confidence: float) -> int | None:
    """Pairs (in all) at which the evidence rule would accept a threshold, were the observed
    false-hit rate p and hit share r at every threshold to stay as they are.

    At one threshold the rule needs n hits with n >= min_hits and, with a confidence, the
    Wilson upper bound at rate p on n hits <= target, that is n >= z^2 t (1 - t) / (t - p)^2
    (the bound's defining equation solved for n; impossible when p >= t). Those hits need
    n / r pairs. The answer is the smallest figure over the thresholds that no higher
    threshold with min_hits hits vetoes (its measured rate over the target), or None when
    none can pass at these rates however many pairs come (the rate itself is over the
    target).
    """
    p = curve.false_hit_rate
    r = curve.hit_rate
    with np.errstate(divide="ignore", invalid="ignore"):
        if confidence > 0:
            z = NormalDist().inv_cdf(confidence)
            n = np.where(p < target, z * z * target * (1 - target) / (target - p) ** 2, np.inf)
        else:
            n = np.where(p <= target, 0.0, np.inf)
        n = np.maximum(np.ceil(n - 1e-9), min_hits)
        need = n / r
    vetoed = np.logical_or.accumulate((curve.hits >= min_hits) & (p > target))
    best = float(np.where(vetoed, np.inf, need).min())
    return math.ceil(best - 1e-9) if math.isfinite(best) else None


def more_pairs_sentence(needed: int | None, pairs: int, hint: str) -> str:
    if needed is None:
        return (
            "more pairs at these rates would not help: wherever the rule could rest, the "
            "measured false-hit rate there or at a higher threshold with enough hits is over "
            f"the target ({hint})"
        )
    return (
        f"give about {max(needed - pairs, 1)} more pairs ({needed} in all, at the observed "
        "false-hit and hit rates)"
    )


def calibrate(
    similarities: npt.ArrayLike,
    same: npt.ArrayLike,
    target: float,
    min_hits: int = 1,
    confidence: float = 0.0,
) -> Calibration:
    """The lowest threshold with at least `min_hits` hits whose false-hit rate is <= `target`
    there and above.

    Requiring every higher threshold to meet the target too keeps a dip in a non-monotone
    curve (a run of lucky same-answer pairs) from being picked with a worse region above it.
    Higher thresholds with fewer than `min_hits` hits are not held against a lower one: one
    wrong pair among the first 50 is a 2% rate that says nothing at a 1% target (the CLI uses
    2 / target, two false hits' worth of evidence). The chosen threshold itself needs
    `min_hits` hits: a threshold resting on fewer is the noise the rule exists to ignore.

    With `confidence` > 0 the rate compared with the target at the chosen threshold is its
    one-sided upper confidence bound (Wilson) rather than the measured share: the threshold
    meets the target with that confidence, not just on these pairs. Higher thresholds veto
    on their measured rate: one whose bound alone is over the target is not evidence against
    a lower one, whose hits include its own (vetoing on bounds sent 3 of 5 CLINC150 folds
    from 0.74 to 0.98 on the noise of a hundred hits).
    """
    if min_hits < 1:
        raise ValueError(f"min_hits must be at least 1, got {min_hits}")
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0, 1), got {confidence}")
    if not 0.0 < target < 1.0:
        raise ValueError(f"the target false-hit rate must be in (0, 1), got {target}")
    curve = sweep(similarities, same)
    rates = _rates(curve, confidence)
    counted = curve.hits >= min_hits
    # A veto says a higher threshold misses the target: its measured rate, not its bound
    # (a bound over the target only says its own hits are too few to be sure, which the
    # lower threshold, holding them and more, answers better).
    vetoes = np.maximum.accumulate(np.where(counted, curve.false_hit_rate, 0.0))
    meets = counted & (vetoes <= target) & (rates <= target)
    if not meets.any():
        needed = pairs_needed(curve, target, min_hits, confidence)
        head = f"no threshold meets a false-hit rate of {target:g}"
        pool = np.flatnonzero(counted)
        if pool.size == 0:
            detail = f" with at least {min_hits} hits: there are only {curve.pairs} pairs in all"
            hint = ""
        else:
            best = int(pool[np.argmin(rates[pool])])
            where = (
                f"threshold {curve.thresholds[best]:.4f}, {curve.false_hits[best]} of "
                f"{curve.hits[best]} hits wrong"
            )
            hint = f"lowest rate {curve.false_hit_rate[best]:.4f} at {where}"
            if confidence > 0:
                detail = (
                    f" with {confidence:.0%} confidence: the lowest upper bound with at least "
                    f"{min_hits} hits is {rates[best]:.4f} ({where})"
                )
            elif best == 0:
                detail = f": even at the highest similarity {where}"
            else:
                detail = (
                    f": the lowest rate with at least {min_hits} hits is {rates[best]:.4f} "
                    f"({where})"
                )
        advice = (
            "; label pairs by the model (`pairs --model`) or lower --confidence"
            if (confidence > 0)
            else ""
        )
        raise NoThresholdError(
            f"{head}{detail}; {more_pairs_sentence(needed, curve.pairs, hint)}{advice}",
            curve,
            needed,
        )
    # Hit counts grow as the threshold falls, so `meets` can have gaps; take its lowest.
    k = int(np.flatnonzero(meets)[-1])
    point = curve.at(float(curve.thresholds[k]))
    log.debug(
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
