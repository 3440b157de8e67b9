"""The calibration rule out of sample: chosen on k-1 folds of the pairs, measured on the fold
it did not see (cache/calibrate.py has the rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hopline.cache.calibrate import calibrate


def fold_ids(similarities: npt.ArrayLike, same: npt.ArrayLike, folds: int, seed: int) -> Any:
    """A fold number per pair, stratified by label, the same for a seed.

    Each label's pairs are shuffled (seeded) and dealt out in turn, so every fold holds the
    same share of different-answer pairs. Not stratified by similarity as well: dealing
    similarity-ranked pairs in turn gives every fold a copy of the same curve, and the
    held-out rate then equals the in-sample one by construction, hiding the very noise
    cross-validation is there to expose.
    """
    s = np.asarray(similarities, dtype=np.float64).ravel()
    y = np.asarray(same, dtype=bool).ravel()
    rng = np.random.default_rng(seed)
    ids = np.empty(s.size, dtype=np.int64)
    start = 0
    for label in (False, True):
        index = rng.permutation(np.flatnonzero(y == label))
        # Continue the deal where the other label stopped, so fold sizes differ by one.
        ids[index] = (np.arange(index.size) + start) % folds
        start += index.size
    return ids


@dataclass(frozen=True)
class Fold:
    """One fold: the threshold the rule chose without it, and what it did on it."""

    threshold: float | None  # None: the rule refused on the other folds
    train_hits: int
    train_false_hits: int
    pairs: int
    hits: int
    false_hits: int

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / self.hits if self.hits else 0.0


@dataclass(frozen=True)
class CrossValidation:
    folds: tuple[Fold, ...]
    seed: int

    @property
    def hits(self) -> int:
        return sum(f.hits for f in self.folds)

    @property
    def false_hits(self) -> int:
        return sum(f.false_hits for f in self.folds)

    @property
    def pairs(self) -> int:
        return sum(f.pairs for f in self.folds)

    @property
    def false_hit_rate(self) -> float:
        """Pooled over the folds: every pair is held out once."""
        return self.false_hits / self.hits if self.hits else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.pairs if self.pairs else 0.0

    @property
    def train_false_hit_rate(self) -> float:
        """The same thresholds on the pairs they were chosen on, pooled: the optimism is the
        gap to the held-out rate."""
        hits = sum(f.train_hits for f in self.folds)
        return sum(f.train_false_hits for f in self.folds) / hits if hits else 0.0

    @property
    def refused(self) -> int:
        return sum(f.threshold is None for f in self.folds)


def cross_validate(
    similarities: npt.ArrayLike,
    same: npt.ArrayLike,
    target: float,
    min_hits: int,
    confidence: float,
    folds: int = 5,
    seed: int = 0,
) -> CrossValidation:
    """The rule run `folds` times, each on all pairs but one fold and measured on that fold.

    A fold whose other pairs give no threshold serves nothing: no hits, no false hits.
    """
    if folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds}")
    s = np.asarray(similarities, dtype=np.float64).ravel()
    y = np.asarray(same, dtype=bool).ravel()
    ids = fold_ids(s, y, folds, seed)
    out: list[Fold] = []
    for k in range(folds):
        test = ids == k
        try:
            r = calibrate(s[~test], y[~test], target, min_hits, confidence)
        except ValueError:  # NoThresholdError, or no same-answer pair left to train on
            out.append(Fold(None, 0, 0, int(test.sum()), 0, 0))
            continue
        hit = test & (s >= r.threshold)
        out.append(
            Fold(
                r.threshold,
                r.hits,
                r.false_hits,
                int(test.sum()),
                int(hit.sum()),
                int((hit & ~y).sum()),
            )
        )
    return CrossValidation(tuple(out), seed)
