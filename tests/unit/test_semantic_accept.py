"""cache/acceptance.py: which semantic candidate answers a lookup. The nearest one at or above
the threshold with the query's unseen parts; none when a runner-up within the margin carries
another answer; and a candidate that cannot change the answer is never tokenized."""

from __future__ import annotations

from hopline.cache.acceptance import accept, eligible
from hopline.cache.store import Entry, Scope
from hopline.protos.hopline.common.v1 import common_pb2

SCOPE: Scope = ("tenant-a", "support-intents", "1", "k1")
OTHER: Scope = ("tenant-b", "support-intents", "1", "k1")
NOW = 1000.0


def entry(text: str, label: str, scope: Scope = SCOPE, expires_at: float = NOW + 60) -> Entry:
    response = common_pb2.Prediction(label=label).SerializeToString()
    return Entry(text, scope, text, response, NOW - 1, expires_at)


class Tokenizer:
    """Unseen parts by table (a text not in it has none), counting what it was asked."""

    def __init__(self, parts: dict[str, tuple[str, ...]] | None = None) -> None:
        self.parts = parts or {}
        self.asked: list[str] = []

    def __call__(self, text: str) -> tuple[str, ...]:
        self.asked.append(text)
        return self.parts.get(text, ())


def test_below_the_threshold_nothing_is_tokenized() -> None:
    tokenizer = Tokenizer()
    found = [(entry("a", "x"), 0.80), (entry("b", "y"), 0.75)]
    verdict = accept(found, SCOPE, NOW, 0.9, 0.05, "q", tokenizer)
    assert verdict.hit is None
    assert not verdict.ambiguous
    assert tokenizer.asked == []


def test_the_nearest_hits_and_candidates_past_the_margin_are_not_tokenized() -> None:
    tokenizer = Tokenizer()
    best = entry("a", "x")
    found = [(best, 0.95), (entry("b", "x"), 0.92), (entry("c", "y"), 0.80)]
    verdict = accept(found, SCOPE, NOW, 0.9, 0.05, "q", tokenizer)
    assert verdict.hit == (best, 0.95)
    assert tokenizer.asked == ["q", "a", "b"]  # "c" is below 0.85: it cannot veto


def test_a_runner_up_within_the_margin_with_another_answer_refuses() -> None:
    found = [(entry("a", "x"), 0.95), (entry("b", "y"), 0.87)]
    verdict = accept(found, SCOPE, NOW, 0.9, 0.05, "q", Tokenizer())
    assert verdict.hit is None
    assert verdict.ambiguous
    # The same runner-up past the margin does not.
    found = [(entry("a", "x"), 0.95), (entry("b", "y"), 0.84)]
    assert accept(found, SCOPE, NOW, 0.9, 0.05, "q", Tokenizer()).hit is not None


def test_other_unseen_parts_are_passed_over_also_as_a_veto() -> None:
    tokenizer = Tokenizer({"q": ("😀",), "decoy": ("🚀",), "match": ("😀",)})
    match = entry("match", "smile")
    found = [(entry("decoy", "rocket"), 0.99), (match, 0.93)]
    verdict = accept(found, SCOPE, NOW, 0.9, 0.05, "q", tokenizer)
    assert verdict.hit == (match, 0.93)
    assert verdict.unseen_mismatches == 1
    # Only the decoy above the threshold: no hit, and the one below is not tokenized.
    found = [(entry("decoy", "rocket"), 0.99), (entry("far", "smile"), 0.50)]
    tokenizer.asked.clear()
    assert accept(found, SCOPE, NOW, 0.9, 0.05, "q", tokenizer).hit is None
    assert tokenizer.asked == ["q", "decoy"]


def test_other_scopes_and_expired_entries_never_answer_or_veto() -> None:
    mine = entry("a", "x")
    found = [
        (entry("t", "y", scope=OTHER), 0.99),
        (entry("e", "y", expires_at=NOW), 0.98),
        (mine, 0.94),
        (entry("u", "z", scope=OTHER), 0.93),
    ]
    assert accept(found, SCOPE, NOW, 0.9, 0.05, "q", Tokenizer()).hit == (mine, 0.94)
    candidates, mismatches = eligible(found, SCOPE, NOW, "q", Tokenizer())
    assert [(c.text, s, label) for c, s, label in candidates] == [("a", 0.94, "x")]
    assert mismatches == 0


def test_eligible_keeps_every_candidate_with_the_query_unseen_parts_nearest_first() -> None:
    tokenizer = Tokenizer({"q": ("x",), "b": ("y",)})
    found = [(entry("a", "l1"), 0.9), (entry("b", "l2"), 0.8), (entry("c", "l3"), 0.2)]
    candidates, mismatches = eligible(found, SCOPE, NOW, "q", tokenizer)
    assert [c.text for c, _, _ in candidates] == []  # "a" and "c" have none, the query has "x"
    assert mismatches == 3
    tokenizer.parts = {"b": ("y",)}
    candidates, mismatches = eligible(found, SCOPE, NOW, "q", tokenizer)
    assert [(c.text, label) for c, _, label in candidates] == [("a", "l1"), ("c", "l3")]
    assert mismatches == 1
    assert eligible([], SCOPE, NOW, "q", tokenizer) == ([], 0)
