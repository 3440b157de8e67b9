"""The /metrics endpoint's HTTP server: one event loop in a daemon thread, not a thread a
connection.

prometheus_client's `start_http_server` starts a thread for every connection and waits on an
idle one for ever: 1,500 connections held open without a request kept 1,510 threads and
100 MB in a gateway (a probe, stop 102), and a NetworkPolicy that opens the port to a
scraping namespace opens it to anything in it. Here an idle connection is a few kilobytes on
one loop, a request's head must arrive within `HEAD_TIMEOUT_S`, at most `MAX_CONNECTIONS`
are held at once (past them a new connection takes the place of the one idle longest, so a
scraper is served however many idle ones are held), and at most `COLLECTORS` scrapes collect
at a time (a gateway with workers scrapes each of them, seconds at worst, so one slow scrape
does not hold the others). What a scrape answers is prometheus_client's own WSGI app,
unchanged: the formats, `?name[]=` filters and gzip are its.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import make_wsgi_app

from hopline.observability.logs import OncePer

log = logging.getLogger("hopline.metrics")

# What asyncio's loop says when accept() fails for want of descriptors or memory.
ACCEPT_OUT_OF_RESOURCE = "socket.accept() out of system resource"
ACCEPT_TROUBLE_EVERY_S = 60.0

HEAD_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
HEAD_LIMIT = 16 * 1024
MAX_CONNECTIONS = 256
COLLECTORS = 4
_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH"})


@dataclass(frozen=True)
class Scrape:
    """One request's head, as far as the WSGI app reads it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]

    def environ(self) -> dict[str, Any]:
        return {
            "REQUEST_METHOD": self.method,
            "PATH_INFO": self.path,
            "QUERY_STRING": self.query,
            "HTTP_ACCEPT": self.headers.get("accept", ""),
            "HTTP_ACCEPT_ENCODING": self.headers.get("accept-encoding", ""),
        }


class BadRequest(Exception):
    """A head that is not an HTTP/1 request."""


def parse_head(head: bytes) -> Scrape:
    """The request line and headers of `head` (up to its blank line)."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError as exc:
        raise BadRequest("not an HTTP request line") from exc
    if method not in _METHODS or not version.startswith("HTTP/1."):
        raise BadRequest("not an HTTP/1 request")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest("a header line without a colon")
        headers[name.strip().lower()] = value.strip()
    try:
        url = urlsplit(target)
    except ValueError as exc:  # "http://[" and the like
        raise BadRequest(f"not a request target: {exc}") from exc
    return Scrape(method, url.path or "/", url.query, headers)


def render(app: Callable[..., Iterable[bytes]], scrape: Scrape) -> bytes:
    """The whole HTTP response the app gives for `scrape` (one request a connection)."""
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answer["status"], answer["headers"] = status, headers

    body = b"".join(app(scrape.environ(), start_response))
    lines = [f"HTTP/1.1 {answer['status']}"]
    lines += [f"{name}: {value}" for name, value in answer["headers"]]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    head = "\r\n".join(lines).encode("latin-1")
    return head if scrape.method == "HEAD" else head + body


def _plain(status: str, text: str) -> bytes:
    body = text.encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class MetricsServer:
    """Serves `registry` on host:port from a loop in a thread of its own."""

    def __init__(self, registry: Any, max_connections: int = MAX_CONNECTIONS) -> None:
        self._app = make_wsgi_app(registry)
        self._max_connections = max_connections
        self._open: set[asyncio.StreamWriter] = set()
        # Connections still waiting for their request's head, oldest first.
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._collect = concurrent.futures.ThreadPoolExecutor(
            COLLECTORS, thread_name_prefix="hopline-metrics-collect"
        )
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_error)
        self._accept_trouble = OncePer(ACCEPT_TROUBLE_EVERY_S)
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self, host: str, port: int) -> int:
        """Bind and serve; the port bound. Raises OSError when it cannot bind."""
        bound: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(host, port, bound), name="hopline-metrics", daemon=True
        )
        self._thread.start()
        self.port = bound.result()
        return self.port

    def stop(self) -> None:
        """Close the listener, its connections and the loop (tests; a service's process
        just exits)."""
        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._collect.shutdown(wait=True, cancel_futures=True)

    def _run(self, host: str, port: int, bound: concurrent.futures.Future[int]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=HEAD_LIMIT)
            )
        except BaseException as exc:
            bound.set_exception(exc)
            self._loop.close()
            return
        bound.set_result(int(self._server.sockets[0].getsockname()[1]))
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for writer in self._open:
                writer.close()
            self._loop.run_until_complete(asyncio.sleep(0))  # the closes reach the sockets
            self._loop.close()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's errors, less the flood of its accept failing: out of descriptors, the
        loop logged it with a traceback up to a hundred times a tick (a hostile client's
        probe, 20,200 connections that never spoke: 226,578 tracebacks, 98 MB, in a
        minute); said once a minute here, with how many were not."""
        if context.get("message") != ACCEPT_OUT_OF_RESOURCE:
            loop.default_exception_handler(context)
            return
        left_out = self._accept_trouble.due(ACCEPT_OUT_OF_RESOURCE)
        if left_out is not None:
            log.warning(
                "the /metrics port cannot accept a connection: the process is out of file "
                "descriptors or memory; said once a minute",
                extra={"error": str(context.get("exception")), "left_out": left_out},
            )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self._max_connections and not self._make_room():
            writer.close()  # every place is mid-answer: a scraper retries
            return
        self._open.add(writer)
        self._waiting[writer] = None
        try:
            await self._answer(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the peer went or stalled, or its place was given away: nothing to answer
        finally:
            self._open.discard(writer)
            self._waiting.pop(writer, None)
            writer.close()

    def _make_room(self) -> bool:
        """Close the connection that has waited longest without sending its request: a
        scraper's new connection is served however many idle ones are held."""
        if not self._waiting:
            return False
        oldest = next(iter(self._waiting))
        del self._waiting[oldest]
        oldest.close()
        return True

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            self._waiting.pop(writer, None)
            scrape = parse_head(head)
        except asyncio.LimitOverrunError:
            response = _plain("431 Request Header Fields Too Large", "request head too large\n")
        except BadRequest as exc:
            response = _plain("400 Bad Request", f"{exc}\n")
        else:
            try:
                response = await self._loop.run_in_executor(
                    self._collect, render, self._app, scrape
                )
            except Exception as exc:  # a collector's bug: the scrape fails, the server serves on
                log.exception("a scrape failed", extra={"error": str(exc)})
                response = _plain("500 Internal Server Error", "collecting the metrics failed\n")
        writer.write(response)
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await writer.drain()


def serve_metrics(host: str, port: int, registry: Any) -> MetricsServer:
    """A started server for `registry` on host:port (port 0: one the kernel picks)."""
    server = MetricsServer(registry)
    server.start(host, port)
    return server
