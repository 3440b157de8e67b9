"""cache/keys.py's normalised text: two texts share an exact key only when the model reads the
same token ids from them (an exact hit serves the cached answer as the model's own)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from conftest import DEFAULT_MODEL
from hopline.cache.keys import MODEL_NORMALIZER, exact_key, normalise_text, normalised_key
from hopline.model.build import default_weights_dir

SCOPE = ("tenant", DEFAULT_MODEL, "1", "{}")
# "cancel my subscription" in full-width letters, which the model reads as [UNK]s
FULL_WIDTH = "".join(chr(ord(c) + 0xFEE0) if c != " " else c for c in "cancel my subscription")

# Pairs a Unicode fold merges and the tokenizer does not: the key must keep them apart.
TOKENIZED_APART = [
    (FULL_WIDTH, "cancel my subscription"),
    ("straße", "strasse"),  # casefold's ß -> ss
    ("x²", "x2"),  # NFKC's superscript
    ("ﬁle a claim", "file a claim"),  # NFKC's ligature
    ("ǅ", "dž"),
    ("a\x1cb", "a b"),  # a control character the tokenizer drops, not a space
]
# Pairs the tokenizer reads alike: one key, so a repeat is a hit.
TOKENIZED_ALIKE = [
    ("Where is my  PARCEL?\n", "where is my parcel?"),
    ("café", "cafe"),  # accents stripped
    ("İstanbul", "istanbul"),
    ("i\u200bphone", "iphone"),  # a zero-width space is dropped
    ("\t reset\u3000my password ", "reset my password"),  # an ideographic space
    ("我想退货", "我 想 退 货"),  # each CJK character is a word of its own
]


@pytest.fixture(scope="module")
def tokenizer(default_repo: Path) -> Tokenizer:
    return Tokenizer.from_file(str(default_repo / DEFAULT_MODEL / "1" / "tokenizer.json"))


def test_the_key_normalizer_is_the_models_tokenizers(default_repo: Path) -> None:
    for path in (
        default_weights_dir() / "tokenizer.json",
        default_repo / DEFAULT_MODEL / "1" / "tokenizer.json",
    ):
        assert json.loads(path.read_text())["normalizer"] == MODEL_NORMALIZER, path


@pytest.mark.parametrize(("a", "b"), TOKENIZED_APART)
def test_texts_the_model_reads_differently_get_different_keys(
    tokenizer: Tokenizer, a: str, b: str
) -> None:
    assert tokenizer.encode(a).ids != tokenizer.encode(b).ids
    assert exact_key(SCOPE, a) != exact_key(SCOPE, b)


@pytest.mark.parametrize(("a", "b"), TOKENIZED_ALIKE)
def test_texts_the_model_reads_alike_share_a_key(tokenizer: Tokenizer, a: str, b: str) -> None:
    assert tokenizer.encode(a).ids == tokenizer.encode(b).ids
    assert exact_key(SCOPE, a) == exact_key(SCOPE, b)


def test_a_normalised_text_reads_as_its_original_and_normalises_to_itself(
    tokenizer: Tokenizer,
) -> None:
    """The semantic tier embeds the normalised text: it must be what the model reads."""
    for text in [t for pair in TOKENIZED_APART + TOKENIZED_ALIKE for t in pair]:
        normalised = normalise_text(text)
        assert tokenizer.encode(normalised).ids == tokenizer.encode(text).ids, text
        assert normalise_text(normalised) == normalised, text


def test_the_ascii_shortcut_normalises_as_the_tokenizers_normalizer(
    tokenizer: Tokenizer,
) -> None:
    normalizer = tokenizer.normalizer
    assert normalizer is not None
    rng = random.Random(78)
    alphabet = [chr(c) for c in range(128)]
    for _ in range(5000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 24)))
        by_tokenizer = " ".join(normalizer.normalize_str(text).split())
        assert normalise_text(text) == by_tokenizer, repr(text)


KEPT_SCOPE = ("acme", "support-intents", "1", '{"digest":"1abb43659d6f74d0","top_k":"1"}')


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            "where is my order 42",
            "fc9899f30f3249d022831c104686bdb86e2591c06332cea60557a395db8b76e0",
        ),
        (
            'quo"te \\ back \u00e9\u4e2d \x01 \u2028 \U0001f600 \t\n',
            "280092feb7594e618a6b614ba7d3bb908612034ff63230c67ad1483f7b98dbd6",
        ),
        ("", "6b5b8777d878c88981f03248ce8253dd841444618cc8d9a813b4f49e46c90c08"),
    ],
)
def test_keys_stay_the_ones_the_cache_holds(text: str, key: str) -> None:
    """Keys are stored in Milvus: a change in how the document is written would orphan every
    entry. These are the SHA-256s of json.dumps([*scope, text]) as keys were first written."""
    document = json.dumps([*KEPT_SCOPE, text], separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(document.encode("utf-8")).hexdigest() == key
    assert normalised_key(KEPT_SCOPE, text) == key
