"""Every error that ends a gateway request with a status is a StatusError with code and message,
and runtime/errors.py's docstring draws each of them where it lives."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from hopline.gateway.errors import RequestError
from hopline.gateway.identity import IdentityError, TenantResolver
from hopline.gateway.upstream import HopError, call_hop
from hopline.runtime import errors
from hopline.runtime.errors import StatusError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "error",
    [
        RequestError(grpc.StatusCode.NOT_FOUND, "unknown model 'x' (serving: a/1)"),
        IdentityError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key"),
        HopError("inference", grpc.StatusCode.UNAVAILABLE, "inference service unavailable"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_each_is_a_status_error_with_code_and_message(error: StatusError) -> None:
    assert isinstance(error, StatusError)
    assert isinstance(error.code, grpc.StatusCode)
    assert error.message
    assert str(error) == error.message


def test_hop_error_keeps_the_hop() -> None:
    error = HopError("tokenize", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    assert (error.hop, error.code, error.message) == (
        "tokenize",
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "deadline exceeded",
    )


def test_what_the_gateway_raises_is_caught_as_a_status_error() -> None:
    with pytest.raises(StatusError) as refused:
        TenantResolver().resolve("\x00", ())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT

    async def failing(request: Any, **_: Any) -> Any:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down", None
        )

    with pytest.raises(StatusError) as failed:
        asyncio.run(call_hop("postprocess", "pp.test:1", failing, None, 1.0, {}))
    assert (failed.value.code, failed.value.message) == (
        grpc.StatusCode.UNAVAILABLE,
        "postprocess service unavailable",
    )


def gateway_exception_classes() -> dict[str, tuple[str, list[str]]]:
    """Every exception class defined in gateway/: name -> (file, its base names).

    Read with `ast`, not imported: gateway/open_inference.py loads hopline's KServe stubs,
    which share the protobuf package `inference` with tritonclient's, and the mesh lane's
    test_kserve.py loads those into this same pytest process.
    """
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted((ROOT / "gateway").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                classes[node.name] = (f"gateway/{path.name}", bases)

    def is_exception(name: str) -> bool:
        if name in classes:
            return any(is_exception(base) for base in classes[name][1])
        return name.endswith(("Error", "Exception")) or name == "StatusError"

    return {name: row for name, row in classes.items() if is_exception(name)}


def test_every_gateway_exception_is_a_status_error_drawn_in_the_tree() -> None:
    found = gateway_exception_classes()
    assert {"RequestError", "IdentityError", "HopError"} <= set(found)

    def is_status_error(name: str) -> bool:
        return name == "StatusError" or (
            name in found and any(is_status_error(base) for base in found[name][1])
        )

    tree = errors.__doc__ or ""
    for name, (where, _) in found.items():
        assert is_status_error(name), f"{name} ({where}) is no StatusError"
        line = next((ln for ln in tree.splitlines() if f" {name} " in ln), "")
        assert where in line, f"runtime/errors.py's tree does not draw {name} in {where}"
