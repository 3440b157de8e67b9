"""model/tokenizer.py: a tokenizer file the `tokenizers` library cannot read is refused naming
the file (the library's own error says only where in the JSON it stopped), so the model
version left out says which of its files to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopline.model.tokenizer import load_tokenizer, vocab_size


@pytest.mark.parametrize("read", [load_tokenizer, vocab_size])
def test_an_unreadable_tokenizer_file_is_named(tmp_path: Path, read: object) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0",', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a tokenizer file") as info:
        read(path)  # type: ignore[operator]
    assert str(path) in str(info.value)
    assert "line 1" in str(info.value)  # the library's reason is kept
