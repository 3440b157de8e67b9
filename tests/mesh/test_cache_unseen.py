"""The semantic tier never matches texts on what the encoder could not see.

Characters outside the tokenizer's vocabulary all become [UNK], and text past the 256-token
limit is cut off, so "what does 无语 mean?" and "what does 装逼 mean?" embed identically
(cosine 1.0): without a guard, one is served the other's answer at any threshold. The real
cache service (milvus-lite) is sent at least 200 such colliding pairs (CJK, emoji, symbols,
truncated tails), each in its own scope, and must miss every one; a paraphrase that keeps
the same unknown characters must still hit, past a colliding decoy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from harness import Mesh
from hopline.model.build import default_weights_dir
from hopline.model.tokenizer import load_tokenizer, unseen
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2

TEMPLATES = ("what does {} mean?", "is {} a good name for my shop?", "please translate {} for me")
RANGES = {
    "cjk": (0x4E00, 0x9FFF),
    "emoji": (0x1F300, 0x1F64F),
    "symbols": (0x2600, 0x27BF),  # miscellaneous symbols, dingbats
}


def unknown_characters(tokenizer: Tokenizer, first: int, last: int, want: int) -> list[str]:
    unk = tokenizer.token_to_id("[UNK]")
    found = []
    for code in range(first, last + 1):
        if tokenizer.encode(chr(code), add_special_tokens=False).ids == [unk]:
            found.append(chr(code))
            if len(found) == want:
                break
    return found


def colliding_pairs(tokenizer: Tokenizer) -> list[tuple[str, str, str]]:
    """(family, a, b): different texts with identical token ids."""
    pairs = []
    for family, (first, last) in RANGES.items():
        chars = unknown_characters(tokenizer, first, last, 132)
        for i in range(0, len(chars) - 1, 2):
            template = TEMPLATES[(i // 2) % len(TEMPLATES)]
            pairs.append((family, template.format(chars[i]), template.format(chars[i + 1])))
    long = " ".join(["my order has not arrived"] * 60)  # far past 256 tokens
    pairs += [("tail", f"{long} {i}", f"{long} {i + 1}") for i in range(0, 20, 2)]
    for _, a, b in pairs:
        assert tokenizer.encode(a).ids == tokenizer.encode(b).ids, (a, b)
        assert unseen(tokenizer, a) != unseen(tokenizer, b), (a, b)
    return pairs


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_weights_dir() / "tokenizer.json")


@pytest.fixture(scope="module")
def cache(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("unseen")
    mesh = Mesh(default_repo, work, HOPLINE_CACHE_FLUSH_MS="2")
    try:
        yield mesh.start(("cache",))
    finally:
        mesh.stop()


def scope(tenant: str) -> common_pb2.Scope:
    return common_pb2.Scope(tenant=tenant, model="support-intents", model_version="1")


def store(stub: cache_pb2_grpc.CacheServiceStub, tenant: str, text: str, label: str) -> None:
    stub.Store(
        cache_pb2.StoreRequest(
            scope=scope(tenant),
            text=text,
            prediction=common_pb2.Prediction(label=label, score=0.9),
            mode="semantic",
        ),
        timeout=30,
    )


def lookup(
    stub: cache_pb2_grpc.CacheServiceStub, tenant: str, text: str
) -> cache_pb2.LookupResponse:
    reply: cache_pb2.LookupResponse = stub.Lookup(
        cache_pb2.LookupRequest(scope=scope(tenant), text=text, mode="semantic", threshold=0.5),
        timeout=30,
    )
    return reply


def settle(cache: Mesh) -> None:
    deadline = time.monotonic() + 60
    while cache.cache_stats().pending_writes:
        assert time.monotonic() < deadline, "stores did not land in Milvus"
        time.sleep(0.05)


def test_no_hit_between_texts_that_differ_only_where_the_encoder_is_blind(
    cache: Mesh, tokenizer: Tokenizer
) -> None:
    pairs = colliding_pairs(tokenizer)
    families = {family for family, _, _ in pairs}
    assert len(pairs) >= 200, len(pairs)
    assert families == {*RANGES, "tail"}, families
    with grpc.insecure_channel(cache.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        for i, (_, a, _) in enumerate(pairs):
            store(stub, f"pair{i}", a, f"answer to {a[:40]}")
        settle(cache)
        hits = [
            (a[:40], b[:40])
            for i, (_, a, b) in enumerate(pairs)
            if lookup(stub, f"pair{i}", b).outcome != common_pb2.CACHE_OUTCOME_MISS
        ]
        assert hits == [], f"{len(hits)} of {len(pairs)} colliding pairs hit: {hits[:5]}"
        # The stored texts themselves are still found (the guard refuses only the blind).
        assert lookup(stub, "pair0", pairs[0][1]).outcome == common_pb2.CACHE_OUTCOME_EXACT


def test_a_paraphrase_with_the_same_unknown_characters_still_hits_past_a_decoy(
    cache: Mesh,
) -> None:
    with grpc.insecure_channel(cache.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        store(stub, "control", "what does 😀 mean?", "smile")
        # Embeds exactly like the entry above; it must neither answer nor, as a runner-up
        # with another answer, veto the real match.
        store(stub, "control", "what does 🚀 mean?", "rocket")
        settle(cache)
        reply = lookup(stub, "control", "what is the meaning of 😀?")
    assert reply.outcome == common_pb2.CACHE_OUTCOME_SEMANTIC, reply
    assert reply.prediction.label == "smile"
