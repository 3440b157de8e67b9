"""The HF `tokenizers` tokenizer as hopline uses it: dynamic padding, truncation at 256.

The bundled tokenizer.json pads every text to a fixed 128 and truncates at 128, but the
model was trained with max_seq_length 256: fixed padding makes the encoder do up to 10x
useless work, and truncating at 128 cuts long texts differently from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

DEFAULT_MAX_LENGTH = 256


@dataclass(frozen=True)
class Batch:
    input_ids: npt.NDArray[np.int64]  # [batch, longest]
    attention_mask: npt.NDArray[np.int64]  # [batch, longest]
    lengths: list[int]
    truncated: list[bool]


def configure(tokenizer: Tokenizer, max_length: int = DEFAULT_MAX_LENGTH) -> Tokenizer:
    tokenizer.enable_truncation(max_length=max_length)
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
    return tokenizer


def _from_file(path: Path) -> Tokenizer:
    """The tokenizer file at `path`; ValueError naming it (the `tokenizers` library's own
    error says where in the JSON it failed, not which file)."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception
        raise ValueError(
            f"{path} is not a tokenizer file the tokenizers library reads: {exc}"
        ) from exc


def load_tokenizer(path: Path, max_length: int = DEFAULT_MAX_LENGTH) -> Tokenizer:
    return configure(_from_file(path), max_length)


def vocab_size(path: Path) -> int:
    """How many token ids the tokenizer file at `path` gives out (ids 0 to n - 1): the rows of
    the model's word embedding table, which fails a run on any other id."""
    return int(_from_file(path).get_vocab_size(with_added_tokens=True))


def encode(tokenizer: Tokenizer, texts: list[str]) -> Batch:
    """Tokenize `texts` together, padded to the longest of them."""
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(len(texts), -1)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64).reshape(ids.shape)
    return Batch(
        input_ids=ids,
        attention_mask=mask,
        # Summed from the lists: numpy's reduction of a row of ones cost more than the list's.
        lengths=[sum(e.attention_mask) for e in encodings],
        truncated=[bool(e.overflowing) for e in encodings],
    )


def unseen(tokenizer: Tokenizer, text: str) -> tuple[str, ...]:
    """What the encoder cannot see of `text`: the characters under each [UNK] token, in order,
    then the tail truncation cut off ('' when none). Empty when it sees everything.

    Two texts with the same token ids embed identically whatever those characters are ("What
    is 😀?" and "What is 🚀?" are both "what is [UNK] ?"), so a semantic match between them
    means nothing unless these parts are equal too.
    """
    encoding = tokenizer.encode(text)
    unk = tokenizer.token_to_id("[UNK]")
    parts = [
        text[start:end]
        for i, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
        if i == unk
    ]
    tail = ""
    if encoding.overflowing:
        seen = [
            end
            for (_, end), special in zip(
                encoding.offsets, encoding.special_tokens_mask, strict=True
            )
            if not special
        ]
        tail = text[max(seen, default=0) :]
    return (*parts, tail) if parts or tail else ()
