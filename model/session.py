"""ONNX Runtime sessions for the encoder, shared by the model build, inference and cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from hopline.model.providers import (
    ProviderSpec,
    as_specs,
    report_fallback,
    session_providers,
)
from hopline.model.tokenizer import encode


def make_session(
    path: Path,
    *,
    threads: int = 0,
    providers: Sequence[ProviderSpec | str] = ("CPUExecutionProvider",),
    spin: bool = False,
) -> ort.InferenceSession:
    """An optimised session on the first of `providers` this machine has (CPU last).
    threads=0 lets ONNX Runtime use every core. `session.get_providers()` says what runs."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    # One request runs at a time per session call; inter-op parallelism only adds contention.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    # Spinning intra-op threads wait for work hot: a 2-thread MiniLM run after 8 ms idle took
    # 4.2 ms spinning and 7.4 ms not (2 cores), but the spinning burns cores other
    # processes of the mesh need. Off unless the caller owns the latency-critical run.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    specs = as_specs(providers)
    chosen = session_providers(specs, ort.get_available_providers(), path.parent)
    session = ort.InferenceSession(str(path), sess_options=options, providers=chosen)
    report_fallback(str(path.parent), specs, session.get_providers())
    return session


def run_texts(
    session: ort.InferenceSession,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    outputs: Sequence[str],
    *,
    batch_size: int = 64,
) -> list[npt.NDArray[np.float32]]:
    """Run `texts` through the graph in length-sorted batches (little padding waste); one
    [len(texts), ...] array per name in `outputs`, in the texts' order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    results: list[npt.NDArray[np.float32]] = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = encode(tokenizer, [texts[i] for i in idx])
        outs = session.run(
            list(outputs), {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        )
        if not results:
            results = [np.empty((len(texts), *o.shape[1:]), dtype=np.float32) for o in outs]
        for result, out in zip(results, outs, strict=True):
            result[idx] = out
    if not results:
        raise ValueError("no texts to embed")
    return results


def embed_texts(
    session: ort.InferenceSession,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    output: str = "sentence_embedding",
) -> npt.NDArray[np.float32]:
    """One output of `texts` (the sentence embeddings by default); see run_texts."""
    (result,) = run_texts(session, tokenizer, texts, [output], batch_size=batch_size)
    return result
