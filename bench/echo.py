"""The transport's floor for `hopline bench`: a grpc.aio server that returns what it gets.

Same server options and event loop as hopline's services, but no interceptors, no tracing,
no protobuf decoding: one unary method, `/hopline.bench.Echo/Echo`, bytes in, bytes out.
Run alone with `python -m hopline.bench.echo --listen 127.0.0.1:PORT`; it prints `READY`
once it accepts calls and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc

from hopline.runtime.server import server_options


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def serve(listen: str) -> int:
    server = grpc.aio.server(options=server_options(4 << 20))
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("hopline.bench.Echo", {"Echo": handler}),)
    )
    try:
        server.add_insecure_port(listen)
    except RuntimeError as exc:
        sys.stderr.write(f"echo: cannot listen on {listen}: {exc}\n")
        return 2
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    await stop.wait()
    await server.stop(1.0)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hopline.bench.echo")
    parser.add_argument("--listen", required=True, help="host:port or unix:PATH")
    raise SystemExit(asyncio.run(serve(parser.parse_args().listen)))


if __name__ == "__main__":
    main()
