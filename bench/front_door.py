"""The least a gRPC front door can cost, for `hopline bench`'s `grpc_batched` baseline.

`inprocess_batched` (the tokenizer, the inference service's own dynamic batcher and settings,
postprocessing) behind a bare grpc.aio server that answers `hopline.gateway.v1` Predict: no
cache, no hops, no spans, no metrics, no admission or tenants. Served on the services' event
loop with their server options, as the echo server is (bench/echo.py).

What it tells apart at 32 callers: `inprocess_batched` has no RPC at all, so a mesh's ratio
to it counts the load generator's gRPC client and the gateway's gRPC server as the mesh's
cost. A mesh's ratio to this server is what hopline's own parts (the cache, its stores, the
hops' wrappers, the trace) cost above any Python gRPC server over the same batcher; this
server's ratio to `inprocess_batched` is what serving over gRPC costs at all.

Run alone with `python -m hopline.bench.front_door --listen 127.0.0.1:PORT --model-repo DIR
[--model NAME[:VERSION]]`; it prints `READY <the loop that runs>` once its model is loaded
and stops on SIGTERM or SIGINT. It answers the model it loaded whatever a request names, and
a request's top-k is the first label's (as `hopline bench` asks).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import grpc

from hopline.bench.echo import chosen_loop, serve_until_signalled, server_arguments
from hopline.bench.targets import InProcessTarget
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.runtime import event_loop
from hopline.runtime.config import ServerConfig
from hopline.runtime.server import server_options

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


class FrontDoor:
    """Predict over the in-process batched pipeline; the service's other methods are not
    registered, so they answer UNIMPLEMENTED."""

    def __init__(self, pipeline: InProcessTarget) -> None:
        self.pipeline = pipeline

    async def Predict(
        self,
        request: gateway_pb2.PredictRequest,
        context: grpc.aio.ServicerContext[gateway_pb2.PredictRequest, gateway_pb2.PredictResponse],
    ) -> gateway_pb2.PredictResponse:
        if not request.text:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
        prediction = (await self.pipeline.call(request.text)).prediction
        config = self.pipeline.config
        return gateway_pb2.PredictResponse(
            prediction=prediction, model=config.name, model_version=config.version
        )


async def serve(listen: str, load: Callable[[], InProcessTarget]) -> int:
    pipeline = load()  # on the loop, as `hopline bench` builds its in-process targets
    server = grpc.aio.server(options=server_options(ServerConfig.max_message_bytes))
    handler = grpc.unary_unary_rpc_method_handler(
        FrontDoor(pipeline).Predict,
        request_deserializer=gateway_pb2.PredictRequest.FromString,
        response_serializer=gateway_pb2.PredictResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Predict": handler}),)
    )
    try:
        return await serve_until_signalled(server, listen, "front door")
    finally:
        await pipeline.close()


def main() -> None:
    from hopline.bench.baselines import inprocess_target

    parser = server_arguments("python -m hopline.bench.front_door")
    parser.add_argument("--model-repo", type=Path, required=True)
    parser.add_argument("--model", default="", help="NAME[:VERSION] (default: the default model)")
    args = parser.parse_args()
    settings = argparse.Namespace(model="", model_repo=args.model_repo, concurrency=None, rps=None)
    raise SystemExit(
        event_loop.run(
            lambda: serve(
                args.listen, lambda: inprocess_target("inprocess_batched", settings, args.model)
            ),
            chosen_loop(args),
        )
    )


if __name__ == "__main__":
    main()
