"""What `hopline cache calibrate` writes: the threshold as a config value, the JSON report
and the plot zoomed to where the decision lies."""

from __future__ import annotations

from dataclasses import asdict
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Any

import numpy as np

from hopline.cache.calibrate import upper_bound
from hopline.cache.checked_calibration import Report


def config_threshold(threshold: float, next_lower: float | None) -> str:
    """The shortest decimal (4 digits or more) that admits exactly the pairs `threshold`
    does: rounded down, and still above the next lower observed similarity."""
    exact = Decimal(repr(threshold))
    for digits in range(4, 18):
        value = exact.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_FLOOR)
        if next_lower is None or float(value) > next_lower:
            return str(value)
    return repr(threshold)


def digits_of(text: str) -> int:
    return len(text.partition(".")[2])


def floor_text(value: float, digits: int) -> str:
    """`value` rounded down to `digits` decimals: never printed above what it is, so a
    value below the threshold never prints equal to it."""
    return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_FLOOR))


def to_json(report: Report) -> dict[str, Any]:
    """The decision, the evidence and the curve. The threshold-level keys describe the rule's
    choice on all pairs (`candidate_threshold`) whether or not it was accepted; `threshold`
    is null unless it was."""
    c = report.curve
    cand = report.candidate
    cv = report.cross_validation
    doc: dict[str, Any] = {
        "accepted": report.accepted,
        "refusal": report.refusal.value if report.refusal else None,
        "reason": report.reason or None,
        "warnings": list(report.warnings),
        "pairs_needed": report.pairs_needed,
        "more_pairs_needed": report.more_pairs if not report.accepted else None,
        "suggested_confidence": report.suggested_confidence,
        "target_false_hit_rate": report.target,
        "confidence": report.confidence,
        "min_hits": report.min_hits,
        "evidence_min_hits": report.evidence_min_hits,
        "threshold": report.threshold,
        "candidate_threshold": cand.threshold if cand else None,
        "config_threshold": config_threshold(cand.threshold, cand.next_lower) if cand else None,
        "next_lower_similarity": cand.next_lower if cand else None,
        "false_hit_rate_bound": cand.false_hit_bound if cand else None,
        "false_hit_rate": cand.false_hit_rate if cand else None,
        "precision": cand.precision if cand else None,
        "recall": cand.recall if cand else None,
        "hit_rate": cand.hit_rate if cand else None,
        "hits": cand.hits if cand else None,
        "false_hits": cand.false_hits if cand else None,
        "pairs": c.pairs,
        "same_pairs": c.same_pairs,
        "cross_validation": None,
        "curve": {
            "threshold": c.thresholds.tolist(),
            "hits": c.hits.tolist(),
            "false_hits": c.false_hits.tolist(),
        },
    }
    if cv is not None:
        doc["cross_validation"] = {
            "folds": len(cv.folds),
            "seed": cv.seed,
            "held_out_false_hit_rate": cv.false_hit_rate,
            "held_out_hit_rate": cv.hit_rate,
            "held_out_hits": cv.hits,
            "held_out_false_hits": cv.false_hits,
            "held_out_pairs": cv.pairs,
            "in_sample_false_hit_rate": cv.train_false_hit_rate,
            "folds_without_threshold": cv.refused,
            "per_fold": [asdict(f) | {"false_hit_rate": f.false_hit_rate} for f in cv.folds],
        }
    return doc


def plot_range(report: Report) -> tuple[float, float]:
    """Where the decision lies: from a little below the lowest threshold whose false-hit
    rate is within 1.5x the target (or the chosen and fold thresholds, if lower) to 1.
    (3x still spanned 0.2..1 on CLINC150 at a 5% target: the rate climbs slowly.)"""
    c = report.curve
    near = c.thresholds[c.false_hit_rate <= 1.5 * report.target]
    marks = [float(near.min())] if near.size else []
    if report.candidate is not None:
        marks.append(report.candidate.threshold)
    if report.cross_validation is not None:
        marks += [f.threshold for f in report.cross_validation.folds if f.threshold is not None]
    if not marks:  # every rate far over the target: the best the curve offers
        counted = c.hits >= min(report.min_hits, c.pairs)
        rates = np.where(counted, c.false_hit_rate, np.inf)
        marks.append(float(c.thresholds[int(np.argmin(rates))]))
    hi = max(1.0, float(c.thresholds[0]))
    lo = min(marks)
    lo -= max(0.1 * (hi - lo), 0.01)
    return lo, hi + 0.005


def plot(report: Report, path: Path) -> None:
    """False-hit rate against the target (top) and precision, recall and hit rate (bottom)
    against the threshold, zoomed to where the decision lies, as a PNG."""
    # Imported here: matplotlib is slow to import and only this offline command needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = report.curve
    lo, hi = plot_range(report)
    fig = Figure(figsize=(8, 7), dpi=110)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    top.plot(c.thresholds, c.false_hit_rate, label="false-hit rate on the pairs")
    if report.confidence > 0:
        top.plot(
            c.thresholds,
            upper_bound(c.false_hits, c.hits, report.confidence),
            linestyle="--",
            label=f"{report.confidence:.0%} upper bound",
        )
    top.axhline(report.target, color="grey", linestyle=":", label=f"target {report.target:g}")
    top.set_ylim(0.0, 3 * report.target)
    top.set_ylabel("false-hit rate")
    bottom.plot(c.thresholds, c.precision, label="precision (1 - false-hit rate)")
    bottom.plot(c.thresholds, c.recall, label="recall")
    bottom.plot(c.thresholds, c.hit_rate, label="hit rate")
    bottom.set_ylim(0.0, 1.02)
    bottom.set_ylabel("share")
    bottom.set_xlabel("cosine similarity threshold")
    cand = report.candidate
    cv = report.cross_validation
    if cv is not None:
        for n, fold in enumerate(f for f in cv.folds if f.threshold is not None):
            for ax in (top, bottom):
                ax.axvline(
                    fold.threshold,
                    color="tab:purple",
                    alpha=0.4,
                    linewidth=0.8,
                    label="fold thresholds" if n == 0 and ax is top else None,
                )
    if cand is not None:
        text = config_threshold(cand.threshold, cand.next_lower)
        for ax in (top, bottom):
            ax.axvline(
                cand.threshold,
                color="black" if report.accepted else "tab:red",
                linestyle="--",
                linewidth=1,
                label=(f"threshold {text}" if report.accepted else f"refused {text}")
                if ax is top
                else None,
            )
    verdict = (
        f"threshold {config_threshold(cand.threshold, cand.next_lower)}"
        if report.accepted and cand is not None
        else "refused"
    )
    if cv is not None:
        verdict += f", held-out false-hit rate {cv.false_hit_rate:.4f}"
    top.set_title(
        f"Semantic cache calibration: target false-hit rate {report.target:g} "
        f"({c.pairs} pairs): {verdict}",
        fontsize=9,
    )
    for ax in (top, bottom):
        ax.set_xlim(lo, hi)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left" if ax is top else "lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
