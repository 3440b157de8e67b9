"""ONNX Runtime sessions for the encoder, shared by the model build, inference and cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from hopline.model.huge_pages import collapsed_after
from hopline.model.providers import (
    ProviderSpec,
    as_specs,
    report_fallback,
    session_providers,
)
from hopline.model.repository import SENTENCE_EMBEDDING
from hopline.model.spin import Spin
from hopline.model.tokenizer import encode
from hopline.runtime.cpu_quota import physical_cores

# How long a thread of a RUN session spins for its next piece of work before it sleeps. The
# gaps between a short run's operators are microseconds, so they are caught; a thread waiting
# behind a long operator (a batch of 32) sleeps soon and leaves its core to the gateway and
# cache beside it. Measured on 2 shared cores, support-intents FP32 (runs alternated, one
# every 2 ms, process CPU per run in brackets): batch 1 OFF 7.96 ms (11.9), RUN unbounded
# 6.11 (11.6), 50 us 5.74 (11.2), 200 us 5.95 (11.4); batch 16 70.1 (139), 66.3 (133), 67.6
# (131), 64.7 (131). A run's CPU is the same either way: an OFF thread pays it in wake-ups.
RUN_SPIN_US = 50


def pool_size(threads: int) -> int:
    """`threads`, or for 0 a thread per physical core this process may use.

    Always a count, never ONNX Runtime's own default, for two reasons. Its default counts the
    machine's cores, too many under a container's CPU limit or an affinity mask
    (runtime/cpu_quota.py says what they cost). And left to choose, it pins each pool thread to
    a core of its own, while the thread that calls `run` (a model thread of hopline's, which
    does a share of every operator) is free to move: when the scheduler puts that thread on
    the core a pool thread is pinned to, the pool thread waits behind it with the other core
    idle, and the caller runs the operators' pieces itself, one thread doing the run. With a
    count given, nothing is pinned and a waiting thread takes the idle core.
    `perf sched` on a co-located mesh at one caller (2-core VM): the pool thread woke on the
    caller's core and waited 2.0-3.4 ms there while the other core was idle or ran the cache's
    writes, then found no work left. Measured (alternated `make run` rounds, c=1 misses,
    2026-12-04): co-located p90 4.94, 4.71, 5.16 ms -> 4.18, 4.21, 4.54, p50 3.67, 3.63, 3.69
    -> 3.42, 3.43, 3.72, 250, 259, 248 -> 277, 272, 254 rps; five processes, the model's run
    p99 7.05, 6.38, 7.51 -> 5.56, 5.45, 4.83 ms."""
    return threads or physical_cores()


ORT_LOG_FATAL = 4  # ONNX Runtime's severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal


def session_options(threads: int, spin: Spin) -> ort.SessionOptions:
    """The options every hopline session runs with: `threads` intra-op threads (0: one per
    physical core this process may use, `pool_size`), one run at a time, `spin` between
    operators."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = pool_size(threads)
    # One request runs at a time per session call; inter-op parallelism only adds contention.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # FATAL only: at ERROR, ONNX Runtime wrote every failed run to stderr in its own coloured
    # format, a raw line a run amid a service's JSON log (tests/unit/test_ort_session_logs.py);
    # the same message comes back as the run's exception, which the service reports itself.
    options.log_severity_level = ORT_LOG_FATAL
    options.add_session_config_entry(
        "session.intra_op.allow_spinning", "0" if spin is Spin.OFF else "1"
    )
    if spin is Spin.RUN:
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(RUN_SPIN_US))
    return options


def make_session(
    path: Path,
    *,
    threads: int = 0,
    providers: Sequence[ProviderSpec | str] = ("CPUExecutionProvider",),
    spin: Spin = Spin.OFF,
) -> ort.InferenceSession:
    """An optimised session on the first of `providers` this machine has (CPU last).
    threads=0 gives it a thread per physical core this process may use.
    `session.get_providers()` says what runs."""
    options = session_options(threads, spin)
    specs = as_specs(providers)
    chosen = session_providers(specs, ort.get_available_providers(), path.parent)
    with collapsed_after():  # the weights on huge pages: model/huge_pages.py says why
        session = ort.InferenceSession(str(path), sess_options=options, providers=chosen)
    report_fallback(str(path.parent), specs, session.get_providers(), ort.get_available_providers())
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
    output: str = SENTENCE_EMBEDDING,
) -> npt.NDArray[np.float32]:
    """One output of `texts` (the sentence embeddings by default); see run_texts."""
    (result,) = run_texts(session, tokenizer, texts, [output], batch_size=batch_size)
    return result
