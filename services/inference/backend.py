"""Inference backends behind one small interface; ONNX Runtime on CPU is the default.

A backend owns one loaded model version. `run` is blocking and is called from a worker
thread: ONNX Runtime releases the GIL while it computes, so the event loop keeps serving.
The version's config chooses the execution providers (TensorRT, CUDA, CPU: see
hopline.model.providers); `providers` is what the session actually runs on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from hopline.model.int8_kernels import warn_if_saturating
from hopline.model.providers import session_providers
from hopline.model.quantize import Precision
from hopline.model.repository import ModelConfig
from hopline.model.run_width import RunWidth, cores
from hopline.model.session import make_session
from hopline.model.spin import Spin

Array = npt.NDArray[np.generic]


class Backend(Protocol):
    config: ModelConfig
    providers: tuple[str, ...]  # what runs, best first

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]: ...


class OnnxRuntimeBackend:
    def __init__(
        self,
        config: ModelConfig,
        threads: int,
        *,
        spin: Spin = Spin.OFF,
        providers: Sequence[str] = (),
    ) -> None:
        """`providers` (ONNX Runtime names) replaces the config's list: a second session of
        a version asks for what the first one runs, so a fallback is reported once."""
        self.config = config
        self.session = make_session(
            config.file("model"),
            threads=threads,
            providers=providers or config.providers,
            spin=spin,
        )
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.providers = tuple(self.session.get_providers())
        if config.precision is Precision.INT8 and self.providers[0] == "CPUExecutionProvider":
            warn_if_saturating(config.key, config.file("model"))

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        names = list(outputs) or self.output_names
        results = self.session.run(names, dict(inputs))
        return dict(zip(names, results, strict=True))


class SideBySideBackend:
    """Every core for a run alone, one core each for runs side by side (threads 0 on CPU).

    Measured on 2 shared cores (AMD EPYC, AVX2; support-intents FP32, runs alternated): one
    2-thread run takes 5.9 ms at batch 1 and 78.5 ms at batch 32, a 1-thread run 6.2 and
    111.8 ms, so two 1-thread runs side by side do 1.42x the rows of one 2-thread run (the
    threads of one run wait for each other at every operator). Under a closed loop of 32
    through the co-located mesh, 158-176 rps in six windows against 129-163 in four for one
    run at a time over every core (means 166 and 143); c=1 unchanged within the noise. A
    lone request still gets every core, where a second thread pays at low load on CPUs whose
    threads wake fast (4.5 vs 7.0 ms on an earlier stop's machine).

    Two sessions of the version: the inference service's RSS with the default FP32 model was 292
    MB against 187 MB with one session. A run takes the wide one when no other run of this
    version is in progress and few recent runs had company (model/run_width.py: RunWidth,
    `NARROW_FROM`), else the narrow one. A run that starts beside a wide one shares its cores
    until it ends, while the wide run's two threads wait for each other at every operator
    (spinning, with `HOPLINE_INFERENCE_SPIN=run`), so under load the every-core session buys a
    run little time and costs a second thread's CPU: under Poisson arrivals at 230 rps through
    the co-located mesh (Intel Xeon VM, 2 cores), 16% of runs started alone and took the wide
    session (1.1 rows on average); they took 8.1 ms of wall time a row and their calling thread
    alone 4.2 ms of CPU a row (the second thread was not counted), where one-row runs on one
    core beside others took 9.7 ms and 5.4 ms of CPU, and a batch-1 run on every core left alone
    takes 2.0-2.9 ms (docs/performance.md). `NARROW_FROM` keeps the wide session for runs that
    stay alone (a closed loop of one never has company) and gives it up while arrivals keep runs
    side by side.
    Against the rule before (a run alone always wide), meshes side by side, alternated 10 s
    rounds: c=32 misses 318.5 -> 328.5 rps (median of 4 rounds, higher in 3, level in 1) and
    299.8 -> 306.3 (6 rounds, higher in 5), the gateway's CPU a request lower in 5 of 6;
    Poisson arrivals at 230 rps, p50 and p99 within the rounds' noise in two runs of 4, the
    CPU a request lower in 6 of 8 rounds and level in 2."""

    def __init__(self, config: ModelConfig, *, spin: Spin = Spin.OFF) -> None:
        self.config = config
        self.wide = OnnxRuntimeBackend(config, 0, spin=spin)
        self.narrow = OnnxRuntimeBackend(config, 1, providers=self.wide.providers)
        self.providers = self.wide.providers
        self.width = RunWidth()

    @property
    def sessions(self) -> tuple[OnnxRuntimeBackend, ...]:
        return (self.wide, self.narrow)

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        with self.width.run() as wide:
            return (self.wide if wide else self.narrow).run(inputs, outputs)


def create_backend(config: ModelConfig, threads: int, *, spin: Spin = Spin.OFF) -> Backend:
    """`threads` ONNX Runtime threads per run; 0: SideBySideBackend where the version runs on
    the CPU (an accelerator's session is not split: one session, all cores)."""
    if config.backend != "onnxruntime":
        raise ValueError(f"{config.key}: unknown backend {config.backend!r} (have: onnxruntime)")
    if threads == 0 and cores() > 1 and expected_providers(config)[0] == "CPUExecutionProvider":
        return SideBySideBackend(config, spin=spin)
    return OnnxRuntimeBackend(config, threads, spin=spin)


# ONNX Runtime's element types, by the names config.json uses (runtime/tensors.py).
ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
}


def graph_problem(backend: Backend) -> str | None:
    """How the version's config.json disagrees with its graph, or None. A config that names
    an input the graph does not have, or declares another width for an output, loaded, was
    listed as the latest version and failed every request with INVALID_ARGUMENT (blaming
    the caller); refused at load, the version before keeps answering."""
    config = backend.config
    onnx = backend.sessions[0] if isinstance(backend, SideBySideBackend) else backend
    if not isinstance(onnx, OnnxRuntimeBackend):
        return None  # another backend's graph is its own to check
    session = onnx.session
    for kind, declared, graph in (
        ("input", config.inputs, {t.name: t for t in session.get_inputs()}),
        ("output", config.outputs, {t.name: t for t in session.get_outputs()}),
    ):
        for spec in declared:
            node = graph.get(spec.name)
            if node is None:
                return (
                    f"config.json names {kind} {spec.name!r}; the graph's {kind}s are "
                    f"{sorted(graph)}"
                )
            shape = list(node.shape)
            fixed = zip(spec.shape, shape, strict=False)
            if len(shape) != len(spec.shape) or any(
                d != -1 and isinstance(g, int) and g != d for d, g in fixed
            ):
                return (
                    f"config.json gives {kind} {spec.name!r} shape {list(spec.shape)}; the "
                    f"graph's is {shape}"
                )
            if ORT_TYPES.get(node.type, spec.dtype) != spec.dtype:
                return (
                    f"config.json gives {kind} {spec.name!r} {spec.dtype}; the graph's is "
                    f"{node.type}"
                )
        if kind == "input" and (unnamed := sorted(set(graph) - {s.name for s in declared})):
            return f"the graph takes inputs config.json does not name: {unnamed}"
    return None


def warm_up(backend: Backend) -> None:
    """Run the shapes first requests will have, so they do not pay for lazy initialisation
    (in every session a backend keeps). ValueError when an output's width is not the one the
    config declares (a graph whose dimension is symbolic says so only when it runs)."""
    config = backend.config
    for each in getattr(backend, "sessions", (backend,)):
        for batch, seq in ((1, 8), (1, 16), (4, 32)):
            ids = np.full((batch, seq), 1000, dtype=np.int64)
            ids[:, 0], ids[:, -1] = 101, 102
            ran = each.run({"input_ids": ids, "attention_mask": np.ones_like(ids)}, [])
            for spec in config.outputs:
                got = list(ran[spec.name].shape)
                if len(got) != len(spec.shape) or any(
                    d != -1 and g != d for d, g in zip(spec.shape, got, strict=True)
                ):
                    raise ValueError(
                        f"config.json gives output {spec.name!r} shape {list(spec.shape)}; a run "
                        f"of the graph gave {got}"
                    )


def expected_providers(config: ModelConfig) -> tuple[str, ...]:
    """The providers a session for `config` would get here, without creating one."""
    import onnxruntime as ort

    chosen = session_providers(
        config.providers, ort.get_available_providers(), config.file("model").parent
    )
    return tuple(name for name, _ in chosen)
