"""The transport's floor for `hopline bench`: a grpc.aio server that returns what it gets.

Same server options and event loop as hopline's services (`HOPLINE_EVENT_LOOP`, read as
they read it: uvloop unless it says otherwise), but no interceptors, no tracing, no protobuf
decoding: one unary method, `/hopline.bench.Echo/Echo`, bytes in, bytes out. The loop is
part of the floor: measured here, a bare echo's p50 at c=1 was 0.70 ms on asyncio's loop and
0.62 on uvloop (server CPU per call 0.54 vs 0.44 ms), so an echo on another loop than the
mesh's would move every target written in echo round trips.

Run alone with `python -m hopline.bench.echo --listen 127.0.0.1:PORT [--loop uvloop|asyncio]`;
it prints `READY <the loop that runs>` once it accepts calls and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import grpc

from hopline.runtime import config as cfg
from hopline.runtime import event_loop
from hopline.runtime.config import ServerConfig
from hopline.runtime.event_loop import EventLoop
from hopline.runtime.parent import LAUNCHER_ENV, follow_parent
from hopline.runtime.server import server_options


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def serve(listen: str) -> int:
    server = grpc.aio.server(options=server_options(ServerConfig.max_message_bytes))
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("hopline.bench.Echo", {"Echo": handler}),)
    )
    return await serve_until_signalled(server, listen, "echo")


async def serve_until_signalled(server: grpc.aio.Server, listen: str, name: str) -> int:
    """A baseline's server on `listen` until SIGTERM or SIGINT: `READY <loop>` on stdout once
    it accepts calls (bench/baselines.py:start_server waits for it); 2 when it cannot listen.
    Started by `hopline bench` (its pid in LAUNCHER_ENV), it ends with it: a bench stopped by
    SIGTERM left its echo server listening, re-parented to init (an operator's probe)."""
    if os.environ.get(LAUNCHER_ENV):
        follow_parent(LAUNCHER_ENV, "hopline bench")
    try:
        server.add_insecure_port(listen)
    except RuntimeError as exc:
        sys.stderr.write(f"{name}: cannot listen on {listen}: {exc}\n")
        return 2
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"READY {event_loop.running()}\n")
    sys.stdout.flush()
    await stop.wait()
    await server.stop(1.0)
    return 0


def services_loop() -> EventLoop:
    """The loop hopline's services run on in this environment (`HOPLINE_EVENT_LOOP`)."""
    return cfg.load(ServerConfig, []).event_loop


def server_arguments(prog: str) -> argparse.ArgumentParser:
    """A baseline server's command line: where it listens and on which loop."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--listen", required=True, help="host:port or unix:PATH")
    parser.add_argument(
        "--loop",
        choices=[loop.value for loop in EventLoop],
        help="the server's event loop (default: the services', HOPLINE_EVENT_LOOP)",
    )
    return parser


def chosen_loop(args: argparse.Namespace) -> EventLoop:
    return EventLoop(args.loop) if args.loop else services_loop()


def main() -> None:
    args = server_arguments("python -m hopline.bench.echo").parse_args()
    raise SystemExit(event_loop.run(lambda: serve(args.listen), chosen_loop(args)))


if __name__ == "__main__":
    main()
