"""What `hopline cache calibrate` decides: the threshold chosen on every pair, accepted only
when the same rule meets the target on pairs it did not see (cache/cross_validation.py), and
otherwise a refusal that says why and what would pass."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy.typing as npt

from hopline.cache.calibrate import (
    Calibration,
    Curve,
    NoThresholdError,
    calibrate,
    default_min_hits,
    more_pairs_sentence,
    pairs_needed,
    sweep,
)
from hopline.cache.cross_validation import CrossValidation, cross_validate

# Tried, in order, for a suggestion when the held-out rate misses the target.
CONFIDENCE_LADDER = (0.8, 0.9, 0.95, 0.975, 0.99, 0.995, 0.999)


class Refusal(enum.StrEnum):
    """Why a candidate threshold was not accepted."""

    NO_THRESHOLD = "no_threshold"  # no threshold meets the rule on all the pairs
    HELD_OUT = "held_out"  # one does, but the rule misses the target out of sample


@dataclass(frozen=True, eq=False)
class Report:
    """What `hopline cache calibrate` decided, and the evidence for it."""

    target: float
    min_hits: int
    confidence: float
    evidence_min_hits: int  # default_min_hits(target): what the warnings measure against
    curve: Curve
    # The rule's choice on all pairs (None: none meets the rule); accepted or not.
    candidate: Calibration | None
    cross_validation: CrossValidation | None
    accepted: bool
    refusal: Refusal | None  # None: accepted
    reason: str
    pairs_needed: int | None  # in all; None: more pairs at these rates would not help
    warnings: tuple[str, ...]
    suggested_confidence: float | None = None

    @property
    def threshold(self) -> float | None:
        return self.candidate.threshold if self.accepted and self.candidate else None

    @property
    def more_pairs(self) -> int | None:
        if self.pairs_needed is None:
            return None
        return max(self.pairs_needed - self.curve.pairs, 1)


def calibrate_checked(
    similarities: npt.ArrayLike,
    same: npt.ArrayLike,
    target: float,
    min_hits: int | None = None,
    confidence: float = 0.9,
    folds: int = 5,
    seed: int = 0,
) -> Report:
    """Choose on all pairs; accept only if the same rule meets the target out of sample.

    The threshold is chosen on every pair (the most evidence), and the rule that chose it is
    cross-validated: chosen on k-1 folds, measured on the fold it did not see. The pooled
    held-out false-hit rate must be <= the target (and rest on at least one hit). Never
    raises NoThresholdError: a refusal is a Report with `accepted` False and the reason.
    """
    evidence = default_min_hits(target)
    rule_min_hits = evidence if min_hits is None else min_hits
    warnings: list[str] = []
    if confidence == 0:
        warnings.append(
            "--confidence 0 compares the measured false-hit rate itself, with no margin for "
            "noise: the lowest threshold that only just meets the target on these pairs "
            "misses it on about half of new samples"
        )
    try:
        candidate: Calibration | None = calibrate(
            similarities, same, target, rule_min_hits, confidence
        )
    except NoThresholdError as exc:
        return Report(
            target,
            rule_min_hits,
            confidence,
            evidence,
            exc.curve if exc.curve is not None else sweep(similarities, same),
            None,
            None,
            False,
            Refusal.NO_THRESHOLD,
            str(exc),
            exc.pairs_needed,
            tuple(warnings),
        )
    assert candidate is not None
    if candidate.hits < evidence:
        warnings.append(
            f"the threshold rests on {candidate.hits} hits, fewer than the evidence rule's "
            f"{evidence} (2 / target: two false hits' worth); --min-hits {rule_min_hits} "
            "allows it"
        )
    cv = cross_validate(similarities, same, target, rule_min_hits, confidence, folds, seed)
    curve = candidate.curve
    refusal: Refusal | None = None
    reason, needed, suggestion = "", None, None
    if cv.refused:
        # Each fold holds (k-1)/k of the pairs: for every fold to choose, the evidence rule
        # needs its figure on the whole curve k/(k-1) times over.
        on_all = pairs_needed(curve, target, rule_min_hits, confidence)
        fold_need = None if on_all is None else math.ceil(on_all * folds / (folds - 1))
        if cv.hits == 0:
            refusal, needed = Refusal.HELD_OUT, fold_need
            reason = (
                f"the threshold {candidate.threshold:.4f} meets a false-hit rate of "
                f"{target:g} on all {curve.pairs} pairs, but the rule finds none on any "
                f"{folds - 1} of {folds} folds, so nothing shows it holds on pairs it did not "
                f"see; {more_pairs_sentence(fold_need, curve.pairs, '')}"
            )
        else:
            more = (
                ""
                if fold_need is None
                else f" (about {max(fold_need - curve.pairs, 1)} more pairs would let every "
                "fold choose one)"
            )
            warnings.append(
                f"{cv.refused} of {folds} folds found no threshold on the other folds' pairs: "
                f"the evidence is marginal{more}"
            )
    if refusal is None and cv.false_hit_rate > target:
        refusal = Refusal.HELD_OUT
        suggestion = _suggest_confidence(
            similarities, same, target, rule_min_hits, confidence, folds, seed
        )
        fix = (
            f"--confidence {suggestion:g} passes"
            if suggestion is not None
            else f"no --confidence up to {CONFIDENCE_LADDER[-1]:g} passes"
        )
        reason = (
            f"the threshold {candidate.threshold:.4f} meets a false-hit rate of {target:g} on "
            f"the pairs it was chosen on ({candidate.false_hit_rate:.4f}), but the same rule "
            f"misses it on pairs it did not see: held-out false-hit rate "
            f"{cv.false_hit_rate:.4f} ({cv.false_hits} of {cv.hits} held-out hits wrong, "
            f"{folds}-fold cross-validation, seed {seed}); the choice is fitted to noise in "
            "these pairs. More pairs alone do not fix this (the margin the bound leaves and "
            f"the noise it guards against shrink together); raise --confidence ({fix})"
        )
    return Report(
        target,
        rule_min_hits,
        confidence,
        evidence,
        curve,
        candidate,
        cv,
        refusal is None,
        refusal,
        reason,
        needed,
        tuple(warnings),
        suggestion,
    )


def _suggest_confidence(
    similarities: npt.ArrayLike,
    same: npt.ArrayLike,
    target: float,
    min_hits: int,
    confidence: float,
    folds: int,
    seed: int,
) -> float | None:
    """The lowest confidence above `confidence` whose choice passes cross-validation."""
    for c in CONFIDENCE_LADDER:
        if c <= confidence:
            continue
        try:
            calibrate(similarities, same, target, min_hits, c)
        except NoThresholdError:
            return None  # higher confidences are stricter still
        cv = cross_validate(similarities, same, target, min_hits, c, folds, seed)
        if cv.hits and cv.false_hit_rate <= target:
            return c
    return None
