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
device or library to load. Whatever runs in the end is read back from the session, logged
once when it is not what was asked, and reported by ListModels.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
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


def session_providers(
    specs: Sequence[ProviderSpec], available: Sequence[str], base: Path
) -> list[tuple[str, ProviderOptions]]:
    """What to hand ONNX Runtime: the asked providers this build of it has, in order.

    Unavailable ones are left out here rather than passed on, because ONNX Runtime answers
    those with a Python warning per session instead of a decision."""
    have = set(available)
    chosen = [(s.provider.value, _ort_options(s, base)) for s in specs if s.provider in have]
    if not any(name == Provider.CPU for name, _ in chosen):
        chosen.append((Provider.CPU.value, {}))
    return chosen


def report_fallback(model: str, specs: Sequence[ProviderSpec], running: Sequence[str]) -> None:
    """One log line when the session runs on less than the config asked for."""
    asked = [s.provider.value for s in specs]
    if list(running) != asked:
        log.warning(
            "execution providers fell back",
            extra={"model": model, "asked": asked, "running": list(running)},
        )


def as_specs(providers: Sequence[ProviderSpec | str]) -> tuple[ProviderSpec, ...]:
    """Specs from a mix of specs and names (callers that pass ONNX Runtime names)."""
    return parse_providers([p.to_json() if isinstance(p, ProviderSpec) else p for p in providers])
