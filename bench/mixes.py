"""Request mixes for `hopline bench`: which texts are sent, and what is sent first.

- miss: every request a text never seen before (a per-run prefix and a counter), so the
  cache can only miss: the full path through every hop.
- exact: a fixed set of texts, each sent once before the window; in the window every
  request repeats one of them exactly. Texts the cache does not keep (the model's policy
  leaves out-of-scope answers uncached) are found by a second pass and left out, or the
  "repeat" window would be partly misses.
- semantic: the same fixed set primed, then paraphrases of it (a different normalised text,
  a close embedding). Hits need a model whose cache mode is `semantic`; the default model is
  exact-only, and the outcome counts in the report say what happened.
- clinc: the CLINC150 test queries from ../shared, in order, repeating when exhausted.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

# Customer-support requests of realistic lengths (6 to 24 tokens), so length buckets matter.
TEMPLATES = (
    "where is my order {n}",
    "I was charged twice on invoice {n}, please refund one of the charges",
    "can't log in to account {n}, I forgot my password",
    "I want to return item {n}, it arrived broken",
    "how do I change the delivery address for order {n}",
    "cancel my subscription {n} please",
    "the app crashes every time I open order {n} on my phone, what should I do",
    "talk to a human about ticket {n}",
    "update the credit card on account {n}",
    "is there a discount code for order {n}",
    "my package {n} says delivered but I never got it",
    "I need an invoice for payment {n} for my company's accounting department",
)
PARAPHRASES = ("please, {t}", "{t}?", "hi, {t}", "{t} thanks", "hello there. {t}")
PRIMED = 64
DEFAULT_CLINC = Path(__file__).resolve().parents[2] / "shared/data/clinc150/data_full.json"


@dataclasses.dataclass(frozen=True)
class Mix:
    name: str
    text: Callable[[int], str]  # the i-th request's text
    prime: tuple[str, ...]  # sent once, in order, before warm-up
    distinct: int | None  # texts in the cycle; None when every request is new


def _fixed(i: int) -> str:
    return TEMPLATES[i % len(TEMPLATES)].format(n=1000 + i)


def _exact(primed: tuple[str, ...]) -> Mix:
    return Mix("exact", lambda i: primed[i % len(primed)], primed, len(primed))


def _semantic(primed: tuple[str, ...]) -> Mix:
    variants = tuple(
        PARAPHRASES[(i // len(primed)) % len(PARAPHRASES)].format(t=primed[i % len(primed)])
        for i in range(len(primed) * len(PARAPHRASES))
    )
    return Mix("semantic", lambda i: variants[i % len(variants)], primed, len(variants))


PRIMED_MIXES: dict[str, Callable[[tuple[str, ...]], Mix]] = {
    "exact": _exact,
    "semantic": _semantic,
}


def narrowed(mix: Mix, kept: Sequence[str]) -> Mix:
    """The same mix over only the primed texts in `kept` (those the cache keeps)."""
    if not kept:
        raise SystemExit(
            f"--mix {mix.name}: the cache kept none of the {len(mix.prime)} primed texts (the "
            "model's cache policy: mode off, out-of-scope answers, or scores below min_score)"
        )
    return PRIMED_MIXES[mix.name](tuple(t for t in mix.prime if t in set(kept)))


def make_mix(name: str, clinc_file: Path | None = None) -> Mix:
    if name == "miss":
        # A fresh prefix per mix: a second run, or a second target, never repeats a text.
        salt = f"{secrets.randbelow(90) + 10}{secrets.randbelow(900) + 100}"
        return Mix(
            "miss",
            lambda i: TEMPLATES[i % len(TEMPLATES)].format(n=f"{salt}{i}"),
            (),
            None,
        )
    primed = tuple(_fixed(i) for i in range(PRIMED))
    if name in PRIMED_MIXES:
        return PRIMED_MIXES[name](primed)
    if name == "clinc":
        path = clinc_file or DEFAULT_CLINC
        if not path.is_file():
            raise SystemExit(
                f"--mix clinc needs the CLINC150 data at {path} (../shared); give --clinc FILE"
            )
        queries = tuple(text for text, _ in json.loads(path.read_text(encoding="utf-8"))["test"])
        return Mix("clinc", lambda i: queries[i % len(queries)], (), len(queries))
    raise SystemExit(f"unknown mix {name!r}: miss, exact, semantic or clinc")
