"""The gateway's per-request memos (gateway/call.py): a repeat's exact key and scope come from
memory, the memos stay within their bounds, and the oldest entry goes first. What a put costs
at the bound is measured, not tested (docs/performance.md, stop 88)."""

from __future__ import annotations

from hopline.cache.keys import exact_key
from hopline.gateway.call import _KeyMemo, _Scopes
from hopline.protos.hopline.inference.v1 import inference_pb2

SCOPE = ("acme", "support-intents", "1", '{"top_k":"1"}')


def test_key_memo_answers_the_exact_key_and_keeps_only_the_newest() -> None:
    memo = _KeyMemo(capacity=3)
    texts = [f"where is my order {n}" for n in range(5)]
    for text in texts:
        assert memo.get(SCOPE, text) == exact_key(SCOPE, text)
    assert list(memo._keys) == [(SCOPE, text) for text in texts[2:]]
    # A repeat is answered from memory and does not move or duplicate its entry.
    assert memo.get(SCOPE, texts[3]) == exact_key(SCOPE, texts[3])
    assert list(memo._keys) == [(SCOPE, text) for text in texts[2:]]
    # The oldest went first: asking for it again computes it and evicts the next oldest.
    assert memo.get(SCOPE, texts[0]) == exact_key(SCOPE, texts[0])
    assert list(memo._keys) == [(SCOPE, t) for t in (texts[3], texts[4], texts[0])]


def test_scope_memo_stays_within_its_bound() -> None:
    memo = _Scopes(capacity=2)
    info = inference_pb2.ModelInfo(name="support-intents", version="1", digest="abc")
    first, first_tuple = memo.get("acme", info, 1)
    assert first_tuple == ("acme", "support-intents", "1", '{"digest":"abc","top_k":"1"}')
    assert memo.get("acme", info, 1)[0] is first  # built once, shared
    memo.get("acme", info, 2)
    memo.get("globex", info, 1)
    assert len(memo._scopes) == 2
    assert memo.get("acme", info, 1)[0] is not first  # the oldest was evicted, built again
