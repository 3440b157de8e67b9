"""gRPC server reflection that also finds a method by its full name.

The reflection protocol lets a client ask for the file containing any symbol, a method
(`hopline.gateway.v1.GatewayService.Predict`) among them, and that is what grpcurl's
`describe` and ghz's reflection mode ask. grpcio-reflection looks every symbol up with the
descriptor pool's `FindFileContainingSymbol`, which under protobuf 7 finds services,
messages and fields but not methods: every such call was NOT_FOUND ("Symbol not found"), on
every service. A method's file is its service's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer as AioReflectionServicer

SERVICE_NAME = reflection.SERVICE_NAME


class ReflectionServicer(AioReflectionServicer):  # type: ignore[misc]
    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        service, _, method = fully_qualified_name.rpartition(".")
        pool: descriptor_pool.DescriptorPool = self._pool
        try:
            if method in pool.FindServiceByName(service).methods_by_name:
                fully_qualified_name = service
        except KeyError:
            pass  # not a service's method: asked as it is
        return super()._file_containing_symbol(request, fully_qualified_name)


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        ReflectionServicer(service_names), server
    )
