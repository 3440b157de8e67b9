"""What a co-located hop's layers cost the gateway's event loop: lone calls of the tokenize and
postprocess hops through gateway/direct_hop.py:StageHop, its short way (a trace not recorded)
against the layered path (call_hop, the stage, the in-process stub and its wrappers), in one
process over the real servicers, in alternated blocks. Two meshes side by side differ by more
than this from placement alone (docs/performance.md, "Co-located hops without their layers");
one process calling both ways in turn does not.

Usage: python bench/scripts/direct_hop_cost.py [--model-repo models] [--model support-intents]
       [--calls 2000] [--blocks 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hopline.gateway.direct_hop import StageHop
from hopline.gateway.stage_batching import BatchedStage
from hopline.gateway.stage_codecs import Codec, PostprocessCodec, TokenizeCodec
from hopline.gateway.upstream import CoLocated
from hopline.model.repository import ModelRepository
from hopline.observability import schema
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime import event_loop
from hopline.runtime.inproc import InProcessService
from hopline.runtime.service_table import ServiceName, spec
from hopline.runtime.tensors import to_tensor


def _stage(pool: CoLocated[Any], hop: str, rpc: str, codec: Codec[Any, Any]) -> Any:
    return BatchedStage(hop, lambda: getattr(pool.stub(), rpc), codec, 1, lambda _: 32)


def _ways(make: Callable[[], StageHop[Any, Any]]) -> tuple[StageHop[Any, Any], ...]:
    """The short way and the layered path (as a recorded trace takes) of one hop."""
    short, layered = make(), make()
    layered._direct = None
    return short, layered


async def _blocks(
    hops: tuple[StageHop[Any, Any], ...], request: Any, calls: int, blocks: int
) -> dict[str, list[float]]:
    """Microseconds a call, per block, each way; the order alternates block by block."""
    short, layered = hops
    ways = {"short": short, "layered": layered}
    result: dict[str, list[float]] = {name: [] for name in ways}
    for block in range(blocks):
        order = list(ways) if block % 2 == 0 else list(reversed(ways))
        for name in order:
            started = time.perf_counter()
            for _ in range(calls):
                await ways[name](request, 5.0, {})
            result[name].append((time.perf_counter() - started) / calls * 1e6)
    return result


async def _main(args: argparse.Namespace) -> None:
    os.environ["HOPLINE_MODEL_REPO"] = str(args.model_repo)
    labels = len(ModelRepository(args.model_repo).resolve(args.model, "").labels)
    tokenizer = CoLocated(
        InProcessService.load(spec(ServiceName.TOKENIZER)), tokenizer_pb2_grpc.TokenizerServiceStub
    )
    postprocess = CoLocated(
        InProcessService.load(spec(ServiceName.POSTPROCESS)),
        postprocess_pb2_grpc.PostprocessServiceStub,
    )
    cases = [
        (
            schema.SPAN_TOKENIZE,
            _ways(
                lambda: StageHop[Any, Any](
                    schema.SPAN_TOKENIZE,
                    tokenizer,
                    _stage(tokenizer, schema.SPAN_TOKENIZE, "Tokenize", TokenizeCodec()),
                    "Tokenize",
                )
            ),
            tokenizer_pb2.TokenizeRequest(model=args.model, texts=["I forgot my password again"]),
        ),
        (
            schema.SPAN_POSTPROCESS,
            _ways(
                lambda: StageHop[Any, Any](
                    schema.SPAN_POSTPROCESS,
                    postprocess,
                    _stage(postprocess, schema.SPAN_POSTPROCESS, "Postprocess", PostprocessCodec()),
                    "Postprocess",
                )
            ),
            postprocess_pb2.PostprocessRequest(
                model=args.model,
                outputs=[to_tensor("logits", np.zeros((1, labels), dtype=np.float32))],
                top_k=1,
            ),
        ),
    ]
    for pool in (tokenizer, postprocess):
        await pool.start()
    try:
        for hop, hops, request in cases:
            result = await _blocks(hops, request, args.calls, args.blocks)
            for name, per_block in result.items():
                kept = per_block[2:]  # the first two blocks warm up
                print(
                    f"{hop:12s} {name:8s} median {statistics.median(kept):7.1f} us a call "
                    f"(blocks: {', '.join(f'{x:.1f}' for x in per_block)})"
                )
    finally:
        for pool in (tokenizer, postprocess):
            await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repo", type=Path, default=Path("models"))
    parser.add_argument("--model", default="support-intents")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    event_loop.run(lambda: _main(args), event_loop.EventLoop.UVLOOP)


if __name__ == "__main__":
    main()
