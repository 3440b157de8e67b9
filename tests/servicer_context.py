"""A stand-in for grpc.aio's ServicerContext in tests that call handlers without a server:
what the runtime's wrappers and the gateway's Predict use of it. `abort` raises, as grpc's
does, and records the status for the test to read."""

from __future__ import annotations

from typing import cast

import grpc

from hopline.runtime.interceptors import Context


class Aborted(Exception):
    pass


class AbortingContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        self.trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        self.aborted = (code, details)
        self.trailing_metadata = trailing_metadata
        raise Aborted(details)

    def code(self) -> grpc.StatusCode | None:
        return self.aborted[0] if self.aborted else None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def time_remaining(self) -> float | None:
        return None

    def as_context(self) -> Context:
        """This object typed as what a handler takes."""
        return cast(Context, self)
