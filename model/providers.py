"""Execution providers chosen by a model version's config, in order, with an honest fallback.

config.json lists what the model should run on, best first:

    "providers": [
      {"name": "tensorrt", "engine_cache_dir": "trt-engines", "fp16": true, "int8": false},
      {"name": "cuda", "device_id": 0},
      "cpu"
    ]

A bare string is a provider with its defaults; ONNX Runtime's own names
(`CUDAExecutionProvider`) are accepted too. ONNX Runtime assigns each node to the first
provider that can run it, so CPU always closes the list: the CPU-only wheel (what `make run`
installs) has neither CUDA nor TensorRT, and a GPU wheel may have them compiled in but no
device or library to load. A GPU provider whose plug-in library needs a library this process
cannot load (the TensorRT provider without TensorRT's libnvinfer, say) is left out before the
session is made: ONNX Runtime would otherwise print an error block, retry on its own fallback
list and drop the provider options asked for. Whatever runs in the end is read back from the
session, logged once with the reason when it is not what was asked, and reported by ListModels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("hopline.model.providers")

ProviderOptions = dict[str, str]


class Provider(enum.StrEnum):
    TENSORRT = "TensorrtExecutionProvider"
    CUDA = "CUDAExecutionProvider"
    CPU = "CPUExecutionProvider"


_ALIASES = {"tensorrt": Provider.TENSORRT, "cuda": Provider.CUDA, "cpu": Provider.CPU}
# config.json keys per provider -> ONNX Runtime provider options (values are passed as strings,
# which every provider's option parser accepts).
_OPTIONS: dict[Provider, dict[str, str]] = {
    Provider.TENSORRT: {
        "engine_cache_dir": "trt_engine_cache_path",
        "fp16": "trt_fp16_enable",
        "int8": "trt_int8_enable",
        "device_id": "device_id",
        "max_workspace_size": "trt_max_workspace_size",
    },
    Provider.CUDA: {"device_id": "device_id"},
    Provider.CPU: {},
}


# The plug-in library each GPU provider is loaded from, beside ONNX Runtime's own.
_PLUGINS = {
    Provider.TENSORRT: "libonnxruntime_providers_tensorrt.so",
    Provider.CUDA: "libonnxruntime_providers_cuda.so",
}


class ProviderConfigError(ValueError):
    """A providers list that names an unknown provider or option."""


@dataclasses.dataclass(frozen=True)
class ProviderSpec:
    provider: Provider
    options: Mapping[str, str | int | bool] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str | dict[str, Any]:
        if not self.options:
            return self.provider.name.lower()
        return {"name": self.provider.name.lower(), **self.options}


def _provider(name: object) -> Provider:
    if isinstance(name, str):
        if name.lower() in _ALIASES:
            return _ALIASES[name.lower()]
        if name in Provider.__members__.values():
            return Provider(name)
    known = ", ".join([*_ALIASES, *(p.value for p in Provider)])
    raise ProviderConfigError(f"unknown execution provider {name!r} (known: {known})")


def parse_providers(raw: Sequence[object]) -> tuple[ProviderSpec, ...]:
    """config.json's `providers` list -> specs, CPU last (added when the list lacks it)."""
    specs: list[ProviderSpec] = []
    for item in raw:
        if isinstance(item, Mapping):
            options = {k: v for k, v in item.items() if k != "name"}
            provider = _provider(item.get("name"))
            unknown = set(options) - set(_OPTIONS[provider])
            if unknown:
                raise ProviderConfigError(
                    f"{provider.name.lower()} takes options {sorted(_OPTIONS[provider])}, "
                    f"not {sorted(unknown)}"
                )
            specs.append(ProviderSpec(provider, options))
        else:
            specs.append(ProviderSpec(_provider(item)))
    if not specs or specs[-1].provider is not Provider.CPU:
        specs = [s for s in specs if s.provider is not Provider.CPU] + [ProviderSpec(Provider.CPU)]
    return tuple(specs)


def _ort_options(spec: ProviderSpec, base: Path) -> ProviderOptions:
    out: ProviderOptions = {}
    for key, value in spec.options.items():
        if key == "engine_cache_dir":
            # Engines are built for one GPU and TensorRT version: cached beside the model
            # version (a relative path is under its folder), built once, then loaded.
            out["trt_engine_cache_enable"] = "True"
            value = str(base / str(value))
        elif isinstance(value, bool):
            value = "True" if value else "False"
        out[_OPTIONS[spec.provider][key]] = str(value)
    return out


def elf_needed(path: Path) -> list[str]:
    """The libraries a 64-bit little-endian ELF shared object names as DT_NEEDED, read from
    its program headers without loading it ([] for anything else)."""
    with path.open("rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return []
        (phoff,) = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        loads, dynamic = [], None
        for i in range(phnum):
            kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if kind == 1:  # PT_LOAD: maps file offsets to addresses
                loads.append((vaddr, offset, filesz))
            elif kind == 2:  # PT_DYNAMIC
                dynamic = (offset, filesz)
        if dynamic is None:
            return []
        f.seek(dynamic[0])
        raw = f.read(dynamic[1])
        entries = [struct.unpack_from("<qQ", raw, i) for i in range(0, len(raw) - 15, 16)]
        tags: dict[int, int] = {}
        needed: list[int] = []
        for tag, value in entries:
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED: an offset into the string table
                needed.append(value)
            tags.setdefault(tag, value)
        strtab, strsz = tags.get(5), tags.get(10)  # DT_STRTAB (an address), DT_STRSZ
        if strtab is None or strsz is None:
            return []
        start = next((o + strtab - v for v, o, n in loads if v <= strtab < v + n), None)
        if start is None:
            return []
        f.seek(start)
        strings = f.read(strsz)
    return [strings[i : strings.index(b"\0", i)].decode() for i in needed]


@functools.cache
def unloadable(provider: Provider, capi: Path) -> str:
    """Why `provider`'s plug-in in ONNX Runtime's `capi` folder cannot load in this process:
    the first library it needs that the dynamic loader cannot find ("" when all load, or
    when there is no plug-in file to read). Only the dependencies are opened, never the
    plug-in itself, which resolves symbols of ONNX Runtime that are not loaded yet."""
    plugin = capi / _PLUGINS.get(provider, "")
    if provider not in _PLUGINS or not plugin.is_file():
        return ""
    for name in elf_needed(plugin):
        try:
            ctypes.CDLL(name, mode=os.RTLD_LAZY)
        except OSError as exc:
            return f"{plugin.name} needs {name}, which does not load: {exc}"
    return ""


def capi_folder() -> Path:
    import onnxruntime as ort

    return Path(ort.__file__).parent / "capi"


def session_providers(
    specs: Sequence[ProviderSpec],
    available: Sequence[str],
    base: Path,
    *,
    capi: Path | None = None,
) -> list[tuple[str, ProviderOptions]]:
    """What to hand ONNX Runtime: the asked providers this build of it has and can load
    here, in order.

    Unavailable ones are left out here rather than passed on, because ONNX Runtime answers
    those with a Python warning per session instead of a decision, and unloadable ones with
    an error block and a retry that drops the options asked for."""
    have = set(available)
    folder = capi or capi_folder()
    chosen = [
        (s.provider.value, _ort_options(s, base))
        for s in specs
        if s.provider in have and not unloadable(s.provider, folder)
    ]
    if not any(name == Provider.CPU for name, _ in chosen):
        chosen.append((Provider.CPU.value, {}))
    return chosen


def fallback_reasons(
    specs: Sequence[ProviderSpec],
    running: Sequence[str],
    available: Sequence[str],
    capi: Path | None = None,
) -> dict[str, str]:
    """Why each asked provider that does not run was left out."""
    folder = capi or capi_folder()
    out = {}
    for spec in specs:
        name = spec.provider.value
        if name in running:
            continue
        if name not in available:
            out[name] = f"not in this ONNX Runtime build (it has {', '.join(available)})"
        else:
            out[name] = unloadable(spec.provider, folder) or "ONNX Runtime did not assign it"
    return out


def report_fallback(
    model: str,
    specs: Sequence[ProviderSpec],
    running: Sequence[str],
    available: Sequence[str] = (),
) -> None:
    """One log line when the session runs on less than the config asked for, with why."""
    asked = [s.provider.value for s in specs]
    if list(running) != asked:
        log.warning(
            "execution providers fell back",
            extra={
                "model": model,
                "asked": asked,
                "running": list(running),
                "why": fallback_reasons(specs, running, available or running),
            },
        )


def as_specs(providers: Sequence[ProviderSpec | str]) -> tuple[ProviderSpec, ...]:
    """Specs from a mix of specs and names (callers that pass ONNX Runtime names)."""
    return parse_providers([p.to_json() if isinstance(p, ProviderSpec) else p for p in providers])
