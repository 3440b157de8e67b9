"""The models inference serves, as the gateway knows them.

Re-read every HOPLINE_MODEL_REFRESH_S, and before any NOT_FOUND: a request naming a model or
version the gateway has not heard of waits for a re-read that started after it asked, so a
model built while the mesh runs is served on its first request; a version removed from the
repository is dropped at the next re-read (inference stops listing it), so a request naming
no version moves back to the newest one left. Re-reads are single-flight:
one ListModels at a time, and every request that missed while one was in flight shares the
next, so a burst of typos costs one call per ListModels round trip, not one per request.
A request waits for that re-read up to its own deadline (DEADLINE_EXCEEDED past it; the
re-read goes on for the others), and is told NOT_FOUND only by a list read after it asked
(UNAVAILABLE when the read failed). A version that is not a positive integer without leading
zeros, and an empty model name, are refused INVALID_ARGUMENT at once: no folder can serve them,
so a re-read would only make the caller wait to be told NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import grpc
from opentelemetry.trace import SpanKind

from hopline.gateway.errors import RequestError
from hopline.gateway.upstream import Pool
from hopline.model.repository import is_version
from hopline.observability import schema
from hopline.observability.logs import Episodes
from hopline.observability.tracing import child_span, outgoing_metadata, untraced
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.runtime.errors import clip

log = logging.getLogger("hopline.gateway.catalogue")
# Inference loads the versions it has not loaded yet before it answers ListModels (so the
# gateway only routes to one that loaded): a few seconds a version on a busy machine. At 5 s
# two versions published under load timed out, and their first requests got NOT_FOUND.
LIST_TIMEOUT_S = 60.0
# The least time between two reads a request for an unknown model starts: each read has
# inference scan its repository, and ModelReady, which takes no key, with a random name
# each call had it read 300 times a second (a security probe: 2,780 reads in 5.2 s from 4
# callers; the tenants' p95 21 -> 53 ms). Requests waiting meanwhile share the next read.
REREAD_MIN_S = 0.5
# Once a list was read: before, the gateway waits for inference (and says so as it waits).
LIST_FAILURES = Episodes(log, "reading the model list failed; serving the list read before")


class ModelCatalogue:
    def __init__(self, inference: Pool[inference_pb2_grpc.InferenceServiceAsyncStub]) -> None:
        self.inference = inference
        self.models: dict[tuple[str, str], inference_pb2.ModelInfo] = {}
        self.latest: dict[str, str] = {}
        # Versions in the repository inference does not serve, with why (its list says).
        self.left_out: dict[tuple[str, str], str] = {}
        self._lock = asyncio.Lock()  # one ListModels at a time
        self._started = 0  # re-reads started so far; the n-th one is number n
        self._done = 0  # the number of the last re-read that finished (or failed)
        self._read_at = -math.inf  # monotonic: when the last read started

    async def refresh(self) -> None:
        """Re-read the model list now (after any re-read in flight); raises on RPC errors."""
        async with self._lock:
            await self._list()

    async def _list(self) -> None:
        self._started += 1
        self._read_at = time.monotonic()
        number = self._started
        try:
            # Within a request (one naming a model the gateway does not know), its trace.
            with child_span(
                schema.SPAN_LIST_MODELS,
                kind=SpanKind.CLIENT,
                attributes={
                    "rpc.system": "grpc",
                    "server.address": self.inference.target,
                    schema.HOP: schema.SPAN_LIST_MODELS,
                },
            ):
                response = await self.inference.stub().ListModels(
                    inference_pb2.ListModelsRequest(),
                    timeout=LIST_TIMEOUT_S,
                    metadata=outgoing_metadata(),
                )
        except grpc.aio.AioRpcError as err:
            if self.models:
                code = err.code().name
                LIST_FAILURES.failed("list", code, status=code, details=err.details())
            raise
        finally:
            self._done = number
        LIST_FAILURES.ended("list")
        models = {(m.name, m.version): m for m in response.models}
        latest: dict[str, str] = {}
        for name, version in models:
            if int(version) > int(latest.get(name, "0")):
                latest[name] = version
        added = sorted(f"{n}/{v}" for n, v in models.keys() - self.models.keys())
        if self.models and added:
            log.info("models added", extra={"models": added})
        if removed := sorted(f"{n}/{v}" for n, v in self.models.keys() - models.keys()):
            log.info("models removed", extra={"models": removed})
        self.models, self.latest = models, latest
        self.left_out = {(v.name, v.version): v.reason for v in response.left_out}

    async def follow(self, every_s: float) -> None:
        """Re-read the list every `every_s`, for good; untraced: no request's work."""
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(grpc.aio.AioRpcError), untraced():
                await self.refresh()

    def _lookup(self, name: str, version: str) -> inference_pb2.ModelInfo | None:
        return self.models.get((name, version or self.latest.get(name, "")))

    async def _reread_after(self, ticket: int) -> grpc.aio.AioRpcError | None:
        """A re-read numbered above `ticket` (one that started after the caller's miss, so it
        has seen whatever the repository held when the request arrived; one in flight now
        may not have); its failure returned, not raised: a caller that gave up waiting for
        it is gone, and the next waiter may take it."""
        async with self._lock:
            if self._done <= ticket:
                await asyncio.sleep(self._read_at + REREAD_MIN_S - time.monotonic())
                try:
                    await self._list()
                except grpc.aio.AioRpcError as err:
                    return err
        return None

    async def resolve(self, name: str, version: str, timeout_s: float) -> inference_pb2.ModelInfo:
        """The model `name` at `version` (the latest when empty), waiting at most `timeout_s`
        for a re-read; RequestError NOT_FOUND when the list read says it is not served,
        UNAVAILABLE when the list could not be read, DEADLINE_EXCEEDED when it is still
        being read (a version published a moment ago is listed once loaded); INVALID_ARGUMENT,
        without a re-read, for a name or version no repository folder can have."""
        self._check_malformed(name, version)
        info = self._lookup(name, version)
        if info is not None:
            return info
        wanted = f"{name}/{version}" if version else name
        # Shielded: the re-read is shared, and one caller's deadline must not cancel it.
        reread = asyncio.ensure_future(self._reread_after(self._started))
        try:
            failed = await asyncio.wait_for(asyncio.shield(reread), timeout_s)
        except TimeoutError:
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"model {wanted!r} is not in the model list, and inference had not answered "
                "a new read of it within the deadline (it loads a new version before listing "
                "it): retry",
            ) from None
        info = self._lookup(name, version)
        if info is not None:
            return info
        if failed is not None:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {wanted!r} is not in the model list, and inference's list could not "
                f"be read again ({failed.code().name}): retry",
            )
        raise RequestError(grpc.StatusCode.NOT_FOUND, self.not_found(name, version))

    def _check_malformed(self, name: str, version: str) -> None:
        """A request no re-read can answer: versions are folders named by a positive integer
        (`model/repository.py:is_version`). Before, "-1", "abc" or "01" each waited half a
        second for a re-read of the list, and inference's rescan of its repository, then got
        NOT_FOUND as if the version might have been published (an operator's probe)."""
        if not name:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the model name is empty: name one (serving: {self.serving()})",
            )
        if version and not is_version(version):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model version {clip(version)!r} of {clip(name)!r} is not a version: versions "
                "are positive integers without leading zeros, or empty for the latest "
                f"(serving: {self.serving()})",
            )

    def not_found(self, name: str, version: str, wanted: str = "") -> str:
        """Why `name` at `version` is not served, as NOT_FOUND says it: a version in the
        repository left out read as one never published, the reason only in inference's log
        (a model author's probe), and a version put into the model's name as "unknown model
        'support-intents/1' (serving: support-intents/1)"."""
        wanted = wanted or (f"{name}/{version}" if version else name)
        why = self.left_out.get((name, version or self.latest.get(name, "")))
        if why is None and not version:  # the name's versions all left out
            why = "; ".join(r for (n, _), r in sorted(self.left_out.items()) if n == name) or None
        if why is not None:
            return f"model {wanted!r} is in the repository but not served: {why}"
        base, _, number = name.rpartition("/")
        if not version and (base, number) in self.models:
            return (
                f"unknown model {wanted!r}: a model's name carries no version; ask for model "
                f"{base!r} with model_version {number!r}"
            )
        return f"unknown model {wanted!r} (serving: {self.serving()})"

    def serving(self) -> str:
        """The model versions listed, as NOT_FOUND names them: a name's in version order
        (they read 1, 10, 2)."""
        keys = sorted(self.models, key=lambda k: (k[0], int(k[1]) if k[1].isdigit() else 0))
        return ", ".join(f"{n}/{v}" for n, v in keys) or "none"
