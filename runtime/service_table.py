"""The one table of hopline's services: the CLI, the launcher, the tests and bench read it.

Servicers and their config classes are named by import path, not imported: the table sits in
the runtime layer, and `hopline serve gateway` must load the gateway's code and nothing else
(no ONNX Runtime, no Milvus).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
from collections.abc import Mapping
from typing import Any

# An upstream address that places the service inside its caller's process
# (hopline.runtime.inproc): the launcher starts no process for it, the gateway runs its servicer.
INPROC = "inproc"


class ServiceName(enum.StrEnum):
    TOKENIZER = "tokenizer"
    CACHE = "cache"
    INFERENCE = "inference"
    POSTPROCESS = "postprocess"
    GATEWAY = "gateway"


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    name: ServiceName
    module: str  # the servicer's module; its config class is importable from it too
    servicer: str
    config: str
    default_addr: str
    metrics_port: int

    @property
    def addr_env(self) -> str:
        """The env var a service listens on, and the gateway and clients dial."""
        return f"HOPLINE_{self.name.upper()}_ADDR"

    def address(self, environ: Mapping[str, str] = os.environ) -> str:
        """The variable's address where set (empty too: a command refuses it, where the
        default dialled another mesh's service, and `cache invalidate` could reach the wrong
        cache; a settings probe), else the table's default."""
        return environ.get(self.addr_env, self.default_addr)

    def colocated(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether callers run this service in their own process (its address is `inproc`)."""
        return self.name != ServiceName.GATEWAY and self.address(environ) == INPROC

    def load(self) -> tuple[type[Any], type[Any]]:
        """(config class, servicer class), importing only this service's module."""
        module = importlib.import_module(self.module)
        return getattr(module, self.config), getattr(module, self.servicer)


# In start order: the gateway last, so its upstreams are coming up when it dials them (it
# waits for them anyway; starting it last keeps the logs readable). 8001 and 8002 are
# Triton's gRPC and metrics ports, so KServe clients' defaults reach the gateway.
SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        ServiceName.TOKENIZER,
        "hopline.services.tokenizer.service",
        "TokenizerService",
        "TokenizerConfig",
        "127.0.0.1:8011",
        8021,
    ),
    ServiceSpec(
        ServiceName.POSTPROCESS,
        "hopline.services.postprocess.service",
        "PostprocessService",
        "PostprocessConfig",
        "127.0.0.1:8014",
        8024,
    ),
    ServiceSpec(
        ServiceName.CACHE,
        "hopline.cache.service",
        "CacheService",
        "CacheConfig",
        "127.0.0.1:8012",
        8022,
    ),
    ServiceSpec(
        ServiceName.INFERENCE,
        "hopline.services.inference.service",
        "InferenceService",
        "InferenceConfig",
        "127.0.0.1:8013",
        8023,
    ),
    ServiceSpec(
        ServiceName.GATEWAY,
        "hopline.gateway.service",
        "GatewayService",
        "GatewayConfig",
        "127.0.0.1:8001",
        8002,
    ),
)

BY_NAME: Mapping[ServiceName, ServiceSpec] = {spec.name: spec for spec in SERVICES}


def spec(name: str) -> ServiceSpec:
    """The table row of `name`; ValueError names the services there are."""
    try:
        return BY_NAME[ServiceName(name)]
    except ValueError:
        known = ", ".join(s.name for s in SERVICES)
        raise ValueError(f"unknown service {name!r} (one of: {known})") from None


class Topology(enum.StrEnum):
    """Where the gateway's upstreams run (`hopline run --topology`, the tests, bench).

    COLOCATED runs the stateless stages inside the gateway (address `inproc`,
    hopline.runtime.inproc) and keeps the cache, which holds state every gateway shares, in a
    process of its own. ONE_PROCESS runs the cache inside the gateway too: the fastest miss on
    one machine, but the cache then has no address of its own (no Invalidate or GetStats for
    operators, no second gateway on its store). README.md "Placement" gives the figures,
    docs/performance.md the history.
    """

    FIVE_PROCESS = "five-process"
    COLOCATED = "colocated"
    ONE_PROCESS = "one-process"

    @property
    def colocated(self) -> tuple[ServiceName, ...]:
        stateless = (ServiceName.TOKENIZER, ServiceName.INFERENCE, ServiceName.POSTPROCESS)
        if self is Topology.COLOCATED:
            return stateless
        if self is Topology.ONE_PROCESS:
            return (*stateless, ServiceName.CACHE)
        return ()

    def addrs(self) -> dict[str, str]:
        """The upstream addresses that place this topology's services in the gateway."""
        return {name: INPROC for name in self.colocated}
