"""Execution providers from a model's config: parsing, the order handed to ONNX Runtime, and
the fallback to CPU on a machine without a GPU, with its one log line. GPU tests run when
ONNX Runtime here has the provider (the `gpu` extra on a GPU machine) and skip otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from conftest import DEFAULT_MODEL
from hopline.model.providers import (
    Provider,
    ProviderConfigError,
    ProviderSpec,
    elf_needed,
    fallback_reasons,
    parse_providers,
    session_providers,
    unloadable,
)
from hopline.model.repository import ModelRepository
from hopline.model.session import make_session

CPU, CUDA, TRT = Provider.CPU.value, Provider.CUDA.value, Provider.TENSORRT.value
GPU_CONFIG: list[object] = [
    {"name": "tensorrt", "engine_cache_dir": "trt-engines", "fp16": True, "int8": False},
    {"name": "cuda", "device_id": 0},
    "cpu",
]


def test_config_lists_parse_in_order_with_cpu_last() -> None:
    specs = parse_providers(GPU_CONFIG)
    assert [s.provider for s in specs] == [Provider.TENSORRT, Provider.CUDA, Provider.CPU]
    assert specs[0].options == {"engine_cache_dir": "trt-engines", "fp16": True, "int8": False}
    # ONNX Runtime's own names are accepted, and CPU closes a list that lacks it.
    assert parse_providers(["CUDAExecutionProvider"]) == (
        ProviderSpec(Provider.CUDA),
        ProviderSpec(Provider.CPU),
    )
    assert parse_providers(["cpu", "cuda"])[-1].provider is Provider.CPU


def test_unknown_providers_and_options_are_refused_by_name() -> None:
    with pytest.raises(ProviderConfigError, match="unknown execution provider 'rocm'"):
        parse_providers(["rocm"])
    with pytest.raises(ProviderConfigError, match=r"cuda takes options \['device_id'\]"):
        parse_providers([{"name": "cuda", "fp16": True}])


def test_options_become_onnxruntime_provider_options(tmp_path: Path) -> None:
    # capi: a folder without plug-ins, so this machine's libraries do not decide (on the H100,
    # whose image lacks TensorRT, the real one left TensorRT out).
    chosen = session_providers(
        parse_providers(GPU_CONFIG), [TRT, CUDA, CPU], tmp_path, capi=tmp_path
    )
    assert chosen == [
        (
            TRT,
            {
                "trt_engine_cache_enable": "True",
                "trt_engine_cache_path": str(tmp_path / "trt-engines"),
                "trt_fp16_enable": "True",
                "trt_int8_enable": "False",
            },
        ),
        (CUDA, {"device_id": "0"}),
        (CPU, {}),
    ]


def test_providers_this_build_lacks_are_left_out(tmp_path: Path) -> None:
    specs = parse_providers(GPU_CONFIG)
    assert session_providers(specs, [CPU], tmp_path, capi=tmp_path) == [(CPU, {})]
    assert session_providers(specs, [CUDA, CPU], tmp_path, capi=tmp_path) == [
        (CUDA, {"device_id": "0"}),
        (CPU, {}),
    ]


def _model_file(repo: Path) -> Path:
    return ModelRepository(repo).resolve(DEFAULT_MODEL).file("model")


def test_asking_for_gpus_without_one_runs_on_cpu_with_one_log_line(
    default_repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if CUDA in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has CUDA: the fallback is what a CPU-only machine shows")
    with caplog.at_level(logging.INFO, logger="hopline.model.providers"):
        session = make_session(_model_file(default_repo), providers=parse_providers(GPU_CONFIG))
    assert session.get_providers() == [CPU]
    lines = [r for r in caplog.records if r.name == "hopline.model.providers"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.WARNING
    assert lines[0].__dict__["asked"] == [TRT, CUDA, CPU]
    assert lines[0].__dict__["running"] == [CPU]
    why = lines[0].__dict__["why"]
    assert set(why) == {TRT, CUDA}
    assert why[CUDA].startswith("not in this ONNX Runtime build (it has ")


ORT_CAPI = Path(ort.__file__).parent / "capi"


def test_elf_needed_reads_a_plugins_dependencies_without_loading_it(tmp_path: Path) -> None:
    needed = elf_needed(ORT_CAPI / "libonnxruntime_providers_shared.so")
    assert "libc.so.6" in needed
    assert all(".so" in name for name in needed)
    text = tmp_path / "not-elf.so"
    text.write_text("#!/bin/sh\n", encoding="utf-8")
    assert elf_needed(text) == []


def _plugin_needing(capi: Path, provider: Provider, missing: bytes) -> None:
    """A real shared object (ONNX Runtime's providers_shared, which every wheel has) saved as
    `provider`'s plug-in, with one needed library renamed to `missing` (same length): what a
    GPU wheel's TensorRT plug-in looks like on a machine without TensorRT."""
    data = (ORT_CAPI / "libonnxruntime_providers_shared.so").read_bytes()
    assert data.count(b"libm.so.6\0") == 1
    capi.mkdir()
    name = {Provider.TENSORRT: "tensorrt", Provider.CUDA: "cuda"}[provider]
    plugin = capi / f"libonnxruntime_providers_{name}.so"
    plugin.write_bytes(data.replace(b"libm.so.6\0", missing + b"\0"))


def test_a_gpu_provider_whose_libraries_do_not_load_is_left_out_with_the_reason(
    tmp_path: Path,
) -> None:
    capi = tmp_path / "capi"
    _plugin_needing(capi, Provider.TENSORRT, b"libq.so.6")
    reason = unloadable(Provider.TENSORRT, capi)
    assert reason.startswith("libonnxruntime_providers_tensorrt.so needs libq.so.6, which does")
    assert unloadable(Provider.CUDA, capi) == ""  # no plug-in file to read: ONNX Runtime decides
    specs = parse_providers(GPU_CONFIG)
    chosen = session_providers(specs, [TRT, CUDA, CPU], tmp_path, capi=capi)
    assert [name for name, _ in chosen] == [CUDA, CPU]
    assert chosen[0][1] == {"device_id": "0"}  # the options asked for survive the fallback
    assert fallback_reasons(specs, [CUDA, CPU], [TRT, CUDA, CPU], capi) == {TRT: reason}


def test_a_plugin_whose_libraries_load_is_kept(tmp_path: Path) -> None:
    capi = tmp_path / "capi"
    _plugin_needing(capi, Provider.CUDA, b"libm.so.6")
    assert unloadable(Provider.CUDA, capi) == ""
    chosen = session_providers(parse_providers(["cuda"]), [CUDA, CPU], tmp_path, capi=capi)
    assert [name for name, _ in chosen] == [CUDA, CPU]


def test_a_cpu_config_logs_nothing(default_repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hopline.model.providers"):
        session = make_session(_model_file(default_repo), providers=["cpu"])
    assert session.get_providers() == [CPU]
    assert [r for r in caplog.records if r.name == "hopline.model.providers"] == []


def _ids() -> dict[str, np.ndarray]:
    ids = np.array([[101, 7592, 2088, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 102]], np.int64)
    return {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)}


@pytest.mark.parametrize("provider", [CUDA, TRT])
def test_gpu_provider_runs_and_agrees_with_cpu(
    default_repo: Path, tmp_path: Path, provider: str
) -> None:
    """On a GPU machine with the `gpu` extra: the provider is really used, and its embeddings
    match the CPU's (FP32 on both; TensorRT may pick TF32 kernels, hence the tolerance)."""
    if provider not in ort.get_available_providers():
        pytest.skip(
            f"{provider} is not in this ONNX Runtime ({ort.get_available_providers()}): "
            "no GPU here, or the `gpu` extra (onnxruntime-gpu, tensorrt) is not installed"
        )
    if reason := unloadable(Provider(provider), ORT_CAPI):
        pytest.skip(f"{provider} is built in but cannot load here: {reason}")
    path = _model_file(default_repo)
    name = "tensorrt" if provider == TRT else "cuda"
    spec: object = {"name": name, "engine_cache_dir": str(tmp_path)} if provider == TRT else name
    gpu = make_session(path, providers=parse_providers([spec]))
    assert gpu.get_providers()[0] == provider
    (want,) = make_session(path).run(["sentence_embedding"], _ids())
    (got,) = gpu.run(["sentence_embedding"], _ids())
    cos = (want * got).sum(axis=1)
    assert cos.min() > 0.999
