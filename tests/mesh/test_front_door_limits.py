"""The gateway's port bounds the streams one connection holds (runtime/server.py:
FRONT_DOOR_LIMITS): gRPC core advertised no limit, and 10 connections of 10,000 Predict
streams that sent their headers only took the gateway from 595 to 1,564 MB and failed 201 of
a steady client's 2,160 calls; HTTP/2 rapid reset on one connection failed 374 of 760 (a
hostile client's probe). Raw HTTP/2 frames over a socket, as such a client sends them."""

from __future__ import annotations

import socket
import struct
import time

from harness import Mesh
from hopline.runtime.server import FRONT_DOOR_MAX_STREAMS_PER_CONNECTION

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS = 1, 3, 4  # frame types
END_HEADERS, ACK = 0x4, 0x1
MAX_CONCURRENT_STREAMS = 3  # the SETTINGS parameter's id


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, plain strings (each under 127)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


PREDICT_HEADERS = b"".join(
    literal(name, value)
    for name, value in (
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/hopline.gateway.v1.GatewayService/Predict"),
        (":authority", "hopline"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    )
)


class Connection:
    def __init__(self, addr: str) -> None:
        host, _, port = addr.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self._buffer = b""
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def read(self, until_s: float) -> list[tuple[int, int, int, bytes]]:
        """Frames read until `until_s` (monotonic) passes: (kind, flags, stream, payload)."""
        frames = []
        while time.monotonic() < until_s:
            self.sock.settimeout(max(0.01, until_s - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            self._buffer += chunk
            while len(self._buffer) >= 9:
                length = int.from_bytes(self._buffer[:3], "big")
                if len(self._buffer) < 9 + length:
                    break
                kind, flags, stream = struct.unpack(">BBI", self._buffer[3:9])
                frames.append((kind, flags, stream & 0x7FFFFFFF, self._buffer[9 : 9 + length]))
                self._buffer = self._buffer[9 + length :]
        return frames

    def settings(self) -> dict[int, int]:
        """The server's first SETTINGS, acknowledged."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for kind, flags, _, payload in self.read(deadline):
                if kind == SETTINGS and not flags & ACK:
                    self.sock.sendall(frame(SETTINGS, ACK, 0))
                    return {key: value for key, value in struct.iter_unpack(">HI", payload)}
        raise AssertionError("no SETTINGS from the server")

    def close(self) -> None:
        self.sock.close()


def test_the_gateway_refuses_a_connections_streams_past_its_limit(mesh: Mesh) -> None:
    limit = FRONT_DOOR_MAX_STREAMS_PER_CONNECTION
    door = Connection(mesh.gateway)
    try:
        assert door.settings().get(MAX_CONCURRENT_STREAMS) == limit
        streams = [1 + 2 * n for n in range(limit + 1)]  # client streams are odd
        door.sock.sendall(
            b"".join(frame(HEADERS, END_HEADERS, s, PREDICT_HEADERS) for s in streams)
        )
        frames = door.read(time.monotonic() + 3)
        reset = {stream for kind, _, stream, _ in frames if kind == RST_STREAM}
        # The streams within the limit wait for their messages; the one past it is refused.
        assert reset == {streams[-1]}
    finally:
        door.close()
    # The hops behind the gateway, which only the gateway dials, keep gRPC's defaults.
    hop = Connection(mesh.addrs["inference"])
    try:
        assert MAX_CONCURRENT_STREAMS not in hop.settings()
    finally:
        hop.close()
