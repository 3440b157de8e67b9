"""`hopline cache eval`'s figures and report (cache/evaluate.py runs the workload): hit rates
and the cache-induced error rate with their confidence bounds, latencies with and without the
cache, and the Markdown, with the static and verified modes side by side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # evaluate.py imports this module to write its report
    from hopline.cache.evaluate import Query


def _pct(values: Sequence[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    a = np.asarray(values, dtype=np.float64)
    return {
        "n": int(a.size),
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "mean_ms": round(float(a.mean()), 3),
    }


def summarise(queries: list[Query], meta: dict[str, Any]) -> dict[str, Any]:
    hits = [q for q in queries if q.outcome in ("exact", "semantic")]
    wrong = [q for q in hits if q.cached_label != q.model_label]
    oos = [q for q in queries if q.oos]
    oos_hits = [q for q in oos if q.outcome in ("exact", "semantic")]
    in_scope = [q for q in queries if not q.oos]

    def rate(part: Sequence[Query], whole: Sequence[Query]) -> float:
        return round(len(part) / len(whole), 4) if whole else 0.0

    by_tier = {
        name: rate([q for q in queries if q.outcome == name], queries)
        for name in ("exact", "semantic", "miss", "fail_open")
    }
    correct_with = sum(q.cached_label == q.label for q in in_scope)
    correct_without = sum(q.model_label == q.label for q in in_scope)
    return {
        **{k: v for k, v in meta.items() if k != "repeats"},
        "model_version": meta.get("model_version", ""),
        "queries": len(queries),
        "hit_rate": rate(hits, queries),
        "hit_rate_in_scope": rate([q for q in in_scope if q in hits], in_scope),
        "hit_rate_by_tier": by_tier,
        "hits": len(hits),
        "hits_from_warmup": sum(q.from_store_split for q in hits),
        "cache_induced_errors": len(wrong),
        "cache_induced_error_rate": rate(wrong, hits),
        "oos_queries": len(oos),
        "oos_hits": len(oos_hits),
        "oos_false_hit_rate": rate(oos_hits, oos),
        # Every cache-induced error, for whoever tunes the threshold or the policy next.
        "cache_induced_error_examples": [
            {
                "text": q.text,
                "truth": q.label,
                "cached": q.cached_label,
                "model": q.model_label,
                "tier": q.outcome,
                "similarity": round(q.similarity, 4),
                "entry_from_warmup": q.from_store_split,
            }
            for q in wrong
        ],
        "accuracy_in_scope_with_cache": round(correct_with / max(1, len(in_scope)), 4),
        "accuracy_in_scope_model_only": round(correct_without / max(1, len(in_scope)), 4),
        "latency": {
            "cache_lookup_hop": {
                name: _pct([q.lookup_ms for q in queries if q.outcome == name])
                for name in ("exact", "semantic", "miss")
            },
            "end_to_end_with_cache": {
                name: _pct([q.total_ms for q in queries if q.outcome == name])
                for name in ("exact", "semantic", "miss")
            },
            "exact_repeats": {
                "sent": len(meta.get("repeats", [])),
                "exact": sum(r[0] == "exact" for r in meta.get("repeats", [])),
                "cache_lookup_hop": _pct([r[1] for r in meta.get("repeats", [])]),
                "end_to_end": _pct([r[2] for r in meta.get("repeats", [])]),
            },
            "model_only_end_to_end": _pct([q.model_total_ms for q in queries]),
            "model_only_inference_hop": _pct([q.inference_ms for q in queries]),
        },
    }


def markdown(report: dict[str, Any]) -> str:
    lat = report["latency"]
    tier = report["hit_rate_by_tier"]
    lines = [
        f"# Cache evaluation: {report['model']} at threshold {report['threshold']}, "
        f"min_score {report['min_score']}",
        "",
        f"{report['queries']} queries ({report['oos_queries']} out of scope) after warming "
        f"with {report['warmed']} texts; tenant `{report['tenant']}`.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| hit rate (all queries) | {report['hit_rate']:.2%} |",
        f"| exact / semantic / miss / fail-open | {tier['exact']:.2%} / {tier['semantic']:.2%}"
        f" / {tier['miss']:.2%} / {tier['fail_open']:.2%} |",
        f"| cache-induced error (share of hits) | {report['cache_induced_error_rate']:.2%} "
        f"({report['cache_induced_errors']} of {report['hits']}) |",
        f"| out-of-scope queries answered from cache | {report['oos_false_hit_rate']:.2%} "
        f"({report['oos_hits']} of {report['oos_queries']}) |",
        f"| in-scope accuracy with / without cache | "
        f"{report['accuracy_in_scope_with_cache']:.2%} / "
        f"{report['accuracy_in_scope_model_only']:.2%} |",
        f"| stored misses resent (timing exact hits) | "
        f"{lat['exact_repeats']['exact']} of {lat['exact_repeats']['sent']} answered EXACT |",
        "",
        "| latency (ms) | n | p50 | p99 |",
        "|---|---|---|---|",
    ]
    rows = [
        *((f"cache hop, {k}", lat["cache_lookup_hop"][k]) for k in ("exact", "semantic", "miss")),
        *(
            (f"end to end, {k}", lat["end_to_end_with_cache"][k])
            for k in ("exact", "semantic", "miss")
        ),
        ("cache hop, exact repeat of a miss", lat["exact_repeats"]["cache_lookup_hop"]),
        ("end to end, exact repeat of a miss", lat["exact_repeats"]["end_to_end"]),
        ("end to end, cache bypassed (model only)", lat["model_only_end_to_end"]),
        ("inference hop, cache bypassed", lat["model_only_inference_hop"]),
    ]
    for name, p in rows:
        if p["n"]:
            lines.append(f"| {name} | {p['n']} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} |")
    if "verified" in report:
        lines += ["", *_modes_table(report, report["verified"])]
    return "\n".join(lines) + "\n"


def _modes_table(static: dict[str, Any], verified: dict[str, Any]) -> list[str]:
    """Static threshold against verified hits, on the same texts in the same order."""
    v = verified["verification"]
    rule = v["rule"] or {}

    def row(name: str, r: dict[str, Any], cost: str) -> str:
        lat = r["latency"]["cache_lookup_hop"]
        hop = " / ".join(
            f"{lat[k]['p50_ms']:.1f}/{lat[k]['p99_ms']:.1f}" if lat[k]["n"] else "-"
            for k in ("semantic", "miss")
        )
        return (
            f"| {name} | {r['hit_rate']:.2%} | {r['cache_induced_error_rate']:.2%} "
            f"({r['cache_induced_errors']} of {r['hits']}) | {r['oos_false_hit_rate']:.2%} "
            f"| {cost} | {hop} |"
        )

    q, w = v["queries"], v["warm_up"]
    return [
        f"## Static threshold against verified hits (target {v['target']:g} of hits, "
        f"{v['confidence']:.0%} confidence)",
        "",
        "| mode | hit rate | cache-induced error | oos from cache | extra inferences "
        "(verification) | cache hop p50/p99 ms, semantic / miss |",
        "|---|---|---|---|---|---|",
        row(f"static {static['threshold']}", static, "0"),
        row(
            f"verified ({verified['model']})",
            verified,
            f"{q['verified_after_reply']} ({q['verified_after_reply'] / verified['queries']:.1%}"
            " of queries)",
        ),
        "",
        f"Verification: {q['candidates']} candidates decided during the queries, "
        f"{q['verified']} compared with the model ({q['disagreements']} disagreed), "
        f"{q['verified_after_reply']} of them served hits checked after the reply; during the "
        f"warm-up {w['candidates']} candidates, {w['verified']} compared "
        f"({w['disagreements']} disagreed), {w['verified_after_reply']} after the reply. "
        f"Rule at the end: threshold {rule.get('threshold', '-')} "
        f"({'learned' if rule.get('learned') else 'static prior'}), "
        f"{rule.get('held_back', 0)} answers held back, "
        f"{rule.get('observations', 0)} observations in the window.",
    ]
