"""The errors a gateway request can end with, each carrying the gRPC status to return."""

from __future__ import annotations

import grpc

from hopline.gateway.identity import IdentityError
from hopline.gateway.upstream import HopError


class RequestError(Exception):
    """A request the gateway refuses before any hop; carries the status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Each has `.code` (grpc.StatusCode) and `.message` (for the caller, actionable).
StatusError = RequestError | IdentityError | HopError
STATUS_ERRORS = (RequestError, IdentityError, HopError)
