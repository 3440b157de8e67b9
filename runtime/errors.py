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

import errno

import grpc

# A failed call's trace id, in its trailing metadata: the failed requests are the ones a user
# most wants to find in Jaeger, and a failure has no reply to carry `trace_id` in.
TRACE_ID_METADATA = "x-hopline-trace-id"


class StatusError(Exception):
    """An error that carries the gRPC status a request ends with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# A client's string echoed in an error message is cut to this many characters: a 16 KB model
# name must not become a 16 KB status message (grpc's metadata limit is 8 KB by default).
ECHO_CHARS = 64


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status a message's status number names (StoreResult.code, PredictStream replies);
    UNKNOWN for a number gRPC does not define."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


# A whole status message's most. The internal services' messages quote what a caller sent
# (input and output names, model names and versions): one quoting a 20,000-character name
# broke gRPC's 16 KiB limit on a trailer, and the caller got RESOURCE_EXHAUSTED "Stream
# removed" in place of its status (a fuzzing probe).
STATUS_CHARS = 2048


def status_text(text: str) -> str:
    """`text` as a status message: at most STATUS_CHARS characters."""
    return clip(text, STATUS_CHARS)


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` as an error message may echo it: at most `limit` characters, `…` marking a cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


# What a host running short says (the errno of an OSError, else the exception's own words).
_SHORT_OF_ERRNO = {
    errno.EMFILE: "file descriptors",
    errno.ENFILE: "file descriptors",
    errno.ENOMEM: "memory",
    errno.ENOSPC: "disk space",
}


def host_shortage(exc: BaseException) -> str | None:
    """What the host ran out of, when `exc` says it did: threads (a thread pool that could not
    start one under a process or pids limit), memory, file descriptors or disk; None for any
    other failure. A call that fails so fails for the host, not for what the caller sent: it
    ends UNAVAILABLE, which a caller retries (on another replica, through the gateway), where
    gRPC would answer UNKNOWN "Unexpected <class 'RuntimeError'>: can't start new thread"
    (a resource-exhaustion probe: 15 of 2,225 requests under a pids limit)."""
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError):
        return _SHORT_OF_ERRNO.get(exc.errno or 0)
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return "threads"
    return None


def shortage_message(short_of: str) -> str:
    """The status message of a call ended by the host's shortage of `short_of`."""
    return (
        f"the server is out of {short_of} for now (a limit of its host is reached); retry "
        "after a backoff: another replica may answer, and the server's log says which limit"
    )
