"""Request mixes for `hopline bench`: which texts are sent, and what is sent first.

- miss: every request a text never seen before (a per-run prefix and a counter), so the
  cache can only miss: the full path through every hop.
- exact: a fixed set of texts, each sent once before the window; in the window every
  request repeats one of them exactly.
- semantic: the same fixed set primed, then paraphrases of it (a different normalised text,
  a close embedding). Hits need a model whose cache mode is `semantic`; the default model is
  exact-only, and the outcome counts in the report say what happened.
- clinc: the CLINC150 test queries from ../shared, in order, repeating when exhausted.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable
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
    if name == "exact":
        return Mix("exact", lambda i: primed[i % PRIMED], primed, PRIMED)
    if name == "semantic":
        variants = tuple(
            PARAPHRASES[(i // PRIMED) % len(PARAPHRASES)].format(t=primed[i % PRIMED])
            for i in range(PRIMED * len(PARAPHRASES))
        )
        return Mix("semantic", lambda i: variants[i % len(variants)], primed, len(variants))
    if name == "clinc":
        path = clinc_file or DEFAULT_CLINC
        if not path.is_file():
            raise SystemExit(
                f"--mix clinc needs the CLINC150 data at {path} (../shared); give --clinc FILE"
            )
        queries = tuple(text for text, _ in json.loads(path.read_text(encoding="utf-8"))["test"])
        return Mix("clinc", lambda i: queries[i % len(queries)], (), len(queries))
    raise SystemExit(f"unknown mix {name!r}: miss, exact, semantic or clinc")
