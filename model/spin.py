"""What ONNX Runtime's threads do between operators: a setting of the inference service and
the cache's embedder, read by their configs. Apart from model/session.py so that reading a
config does not load ONNX Runtime (`hopline cache milvus-user` reads the cache's)."""

from __future__ import annotations

import enum


class Spin(enum.StrEnum):
    """What ONNX Runtime's intra-op threads do while they wait for work.

    A thread that sleeps between two operators is woken by a futex for the next one; a
    MiniLM run has 100-200 operators, mostly small at batch 1, so the wake-ups are a large
    share of a short run. Measured on 2 cores (support-intents, batch 1, runs 2 ms apart):
    FP32 4.77 ms sleeping vs 4.14 ms spinning during the run; INT8 2.96 vs 2.20 ms. Between
    runs spinning is pure waste: ORT's default (ALWAYS) burned 24 ms of CPU per 20 ms gap,
    against 1 ms more per run than OFF for RUN."""

    OFF = "off"  # sleep between operators: the slowest short runs
    RUN = "run"  # spin (RUN_SPIN_US at most per wait) while a run is in progress
    ALWAYS = "always"  # keep spinning after a run too: only for a core nobody else needs
