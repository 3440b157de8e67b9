"""A DNS server on loopback that answers A records from a table the test changes.

gRPC's resolver takes a DNS server in the target's authority
(`dns://127.0.0.1:PORT/name:port`), so a test can give a name the replicas it wants, and
change them mid-test, as Kubernetes does for a headless Service when pods come and go. Names
outside the table get NXDOMAIN; AAAA and every other type get an empty answer.
"""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType
from typing import Self

A, IN, TTL = 1, 1, 1
NOERROR, NXDOMAIN = 0x8180, 0x8183  # flags: a recursive answer, with its rcode


class DnsServer:
    def __init__(self, records: dict[str, list[str]]) -> None:
        self._records = {name.lower(): list(ips) for name, ips in records.items()}
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self.queries: list[str] = []  # names asked for A records, in order
        self._thread = threading.Thread(target=self._serve, name="dns", daemon=True)

    def authority(self, name: str, port: int) -> str:
        """A gRPC target that resolves `name` here."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self._records[name.lower()] = list(ips)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._socket.close()  # the thread's recvfrom fails and it ends
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self._socket.recvfrom(512)
            except OSError:
                return
            reply = self._answer(query)
            if reply is not None:
                self._socket.sendto(reply, peer)

    def _answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        (txid,) = struct.unpack("!H", query[:2])
        at, labels = 12, []
        while at < len(query) and query[at]:
            size = query[at]
            labels.append(query[at + 1 : at + 1 + size].decode("ascii", "replace"))
            at += size + 1
        if at + 5 > len(query):
            return None
        qtype = struct.unpack("!H", query[at + 1 : at + 3])[0]
        question = query[12 : at + 5]
        name = ".".join(labels).lower()
        with self._lock:
            ips = self._records.get(name)
            if qtype == A:
                self.queries.append(name)
        answers = ips if ips is not None and qtype == A else []
        flags = NOERROR if ips is not None else NXDOMAIN
        header = struct.pack("!HHHHHH", txid, flags, 1, len(answers), 0, 0)
        records = b"".join(
            b"\xc0\x0c" + struct.pack("!HHIH", A, IN, TTL, 4) + socket.inet_aton(ip)
            for ip in answers
        )
        return header + question + records
