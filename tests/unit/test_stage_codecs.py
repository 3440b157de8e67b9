"""gateway/stage_codecs.py: a stage batch's reply split back per request keeps the model
digest the service answered from (the gateway caches an answer only when each stage's
digest is the scope's: gateway/model_path.py:check_files)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hopline.gateway.stage_codecs import Codec, InferCodec, PostprocessCodec, TokenizeCodec
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2
from hopline.runtime.tensors import to_tensor

DIGEST = "0123456789abcdef"


def test_every_split_reply_keeps_the_digest_of_the_batch() -> None:
    tokenize = [tokenizer_pb2.TokenizeRequest(model="m", texts=[t]) for t in ("a b", "c")]
    ids = np.array([[101, 1, 2, 102], [101, 3, 102, 0]], dtype=np.int64)
    tokens = tokenizer_pb2.TokenizeResponse(
        input_ids=to_tensor("input_ids", ids),
        attention_mask=to_tensor("attention_mask", (ids > 0).astype(np.int64)),
        model_digest=DIGEST,
    )
    split_tokens = TokenizeCodec().split(tokenize, tokens)

    infer = [
        inference_pb2.InferRequest(model="m", inputs=[to_tensor("input_ids", ids[i : i + 1])])
        for i in range(2)
    ]
    inferred = inference_pb2.InferResponse(
        outputs=[to_tensor("logits", np.zeros((2, 3), dtype=np.float32))], model_digest=DIGEST
    )
    split_inferred = InferCodec().split(infer, inferred)

    post = [
        postprocess_pb2.PostprocessRequest(
            model="m", outputs=[to_tensor("logits", np.zeros((1, 3), dtype=np.float32))]
        )
        for _ in range(2)
    ]
    answered = postprocess_pb2.PostprocessResponse(
        predictions=[common_pb2.Prediction(label="x"), common_pb2.Prediction(label="y")],
        model_digest=DIGEST,
    )
    split_answered = PostprocessCodec().split(post, answered)

    for parts in (split_tokens, split_inferred, split_answered):
        assert [p.model_digest for p in parts] == [DIGEST, DIGEST]
    assert [p.predictions[0].label for p in split_answered] == ["x", "y"]


def test_rows_expecting_other_files_never_share_a_batch_and_a_batch_says_its_rows_files() -> None:
    """A request asked again to make a lagging stage reload (gateway/model_path.py) expects
    other files than the rows beside it: in one RPC, one of them would not be asked for its."""
    ids = to_tensor("input_ids", np.array([[101, 7, 102]], dtype=np.int64))
    logits = to_tensor("logits", np.zeros((1, 3), dtype=np.float32))
    cases: list[tuple[Codec[Any, Any], list[Any]]] = [
        (
            TokenizeCodec(),
            [tokenizer_pb2.TokenizeRequest(model="m", texts=["a"], model_digest=d) for d in "ab"],
        ),
        (
            InferCodec(),
            [inference_pb2.InferRequest(model="m", inputs=[ids], model_digest=d) for d in "ab"],
        ),
        (
            PostprocessCodec(),
            [
                postprocess_pb2.PostprocessRequest(model="m", outputs=[logits], model_digest=d)
                for d in "ab"
            ],
        ),
    ]
    for codec, (a, b) in cases:
        assert codec.key(a) != codec.key(b), type(codec).__name__
        assert codec.merge([a, a]).model_digest == "a", type(codec).__name__
