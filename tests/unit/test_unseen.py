"""model/tokenizer.py:unseen: what the encoder cannot see of a text, with the real tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from hopline.model.build import default_weights_dir
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer, unseen


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_weights_dir() / "tokenizer.json")


def test_a_text_the_vocabulary_covers_has_nothing_unseen(tokenizer: Tokenizer) -> None:
    assert unseen(tokenizer, "where is my parcel?") == ()


def test_the_characters_under_each_unk_in_order(tokenizer: Tokenizer) -> None:
    a, b = "what does 无语 mean? 😀", "what does 装逼 mean? 😀"
    assert tokenizer.encode(a).ids == tokenizer.encode(b).ids  # the collision itself
    assert unseen(tokenizer, a) == ("无", "语", "😀", "")
    assert unseen(tokenizer, b) == ("装", "逼", "😀", "")
    assert unseen(tokenizer, "what is 😀?") != unseen(tokenizer, "what is 🚀?")


def test_the_tail_truncation_cuts_off(tokenizer: Tokenizer) -> None:
    long = " ".join(["parcel"] * (DEFAULT_MAX_LENGTH + 10))
    a, b = f"{long} red", f"{long} blue"
    assert tokenizer.encode(a).ids == tokenizer.encode(b).ids
    assert unseen(tokenizer, a)[-1].endswith("red")
    assert unseen(tokenizer, b)[-1].endswith("blue")
    assert unseen(tokenizer, long[:100]) == ()
