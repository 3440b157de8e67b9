"""The one base class of the errors that end a request with a gRPC status.

    StatusError           runtime/errors.py    .code (grpc.StatusCode), .message (for the caller)
    ├── RequestError      gateway/errors.py    the gateway refuses a request before any hop:
    │                                          empty or oversized text, unknown model, bad top_k
    ├── IdentityError     gateway/identity.py  no API key, an unknown one, or another tenant's
    └── HopError          gateway/upstream.py  an upstream call failed; .hop names the service

A handler catches StatusError once and aborts with its code and message (Predict, ModelInfer),
or puts them in the reply (a PredictStream message). The message is what the caller reads, so
it says what to change: "text is empty: put the text to classify in PredictRequest.text", not
"bad request". It lives in the runtime layer, which imports nothing above it, so any service
can raise these without depending on the gateway.
"""

from __future__ import annotations

import grpc


class StatusError(Exception):
    """An error that carries the gRPC status a request ends with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
