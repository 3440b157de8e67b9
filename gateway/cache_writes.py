"""The gateway's writes to the cache, off each reply's path: stores and verification reports.

A store goes in one StoreBatch with the others of its linger window when the gateway batches
its stages (gateway/store_queue.py, HOPLINE_GATEWAY_STORE_LINGER_MS), else alone; a cache
from before StoreBatch gets Store calls for a minute at a time. Every call is a task the
gateway waits for, briefly, when it stops, so a draining gateway's answers still reach the
cache. Which answers are stored, and what the gateway keeps itself meanwhile, is the
gateway's decision (gateway/cache_path.py:CachePath.store_later); this module only sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc

from hopline.gateway.call import PredictCall
from hopline.gateway.store_queue import FENCED, STORE_FAILURES, STORES, StoreQueue
from hopline.gateway.upstream import HopError, Pool, Upstream, call_hop
from hopline.observability import metrics, schema
from hopline.observability.logs import Episodes
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2

log = logging.getLogger("hopline.gateway")
REPORT_FAILURES = Episodes(log, "verification report failed")
REPORTS = "reports"

WRITE_TIMEOUT_S = 2.0  # per write; a write is never on a reply's path
DRAIN_WAIT_S = 2.0  # how long a stopping gateway waits for its writes
UNARY_FALLBACK_S = 60.0  # Store calls this long after a cache answered StoreBatch UNIMPLEMENTED


class CacheWrites:
    def __init__(
        self,
        cache: Pool[cache_pb2_grpc.CacheServiceAsyncStub],
        *,
        batched: bool,
        linger_s: float = 0.0,
        in_flight: int = 1,
    ) -> None:
        self.cache = cache
        self.tasks: set[asyncio.Task[None]] = set()
        self._unary_until = 0.0  # monotonic; Store instead of StoreBatch before it
        self.queue = (
            StoreQueue(
                self._store_batch,
                self._store_each,
                self.spawn,
                linger_s=linger_s,
                in_flight=in_flight,
                address=cache.target,
                hurry=cache.none_serving if isinstance(cache, Upstream) else lambda: False,
            )
            if batched
            else None
        )

    @property
    def in_flight(self) -> int:
        """Writes not done yet: calls on their way and stores waiting for theirs."""
        return len(self.tasks) + (len(self.queue) if self.queue is not None else 0)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` off the reply's path, as one of the writes a stopping gateway waits for."""
        spawn(coro, self.tasks)

    def store(self, call: PredictCall, prediction: common_pb2.Prediction) -> None:
        policy = call.info.cache
        request = cache_pb2.StoreRequest(
            scope=call.scope,
            text=call.text,
            prediction=prediction,
            ttl_s=policy.ttl_s,
            max_entries=policy.max_entries,
            mode=policy.mode,
        )
        if self.queue is not None and time.monotonic() >= self._unary_until:
            self.queue.put(request)
        else:
            self.spawn(self._store_alone(request))

    def report(self, call: PredictCall, prediction: common_pb2.Prediction) -> None:
        """A candidate the cache did not serve yet: the model's answer is its evidence."""
        if call.verify_id:
            self.spawn(self.send_report(call, prediction))

    async def send_report(self, call: PredictCall, prediction: common_pb2.Prediction) -> None:
        if call.files_differ:
            # An answer from another build of the version than the entry's scope names (one
            # the model list does not name yet) is no evidence about the entry: the
            # verification threshold must not learn from it. The candidate stays unverified
            # and is asked about again.
            return
        try:
            await call_hop(
                schema.SPAN_CACHE_VERIFY,
                self.cache.target,
                self.cache.stub().ReportVerification,
                cache_pb2.ReportVerificationRequest(
                    verify_id=call.verify_id, prediction=prediction
                ),
                WRITE_TIMEOUT_S,
                {},
            )
        except HopError as err:
            REPORT_FAILURES.failed(REPORTS, err.code.name, status=err.code.name)
            return
        REPORT_FAILURES.ended(REPORTS)

    async def close(self) -> None:
        """Send what lingers, give the writes on their way a moment, cancel the rest."""
        if self.queue is not None:
            self.queue.flush()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=DRAIN_WAIT_S)
        for task in self.tasks:
            task.cancel()

    async def _store_alone(self, request: cache_pb2.StoreRequest) -> None:
        try:
            await call_hop(
                schema.SPAN_CACHE_STORE,
                self.cache.target,
                self.cache.stub().Store,
                request,
                WRITE_TIMEOUT_S,
                {},
            )
        except HopError as err:
            if err.code == FENCED:
                metrics.CACHE_STORES.labels("skipped_invalidated").inc()
                return
            metrics.CACHE_STORES.labels("error").inc()
            STORE_FAILURES.failed(STORES, err.code.name, status=err.code.name, stores=1)
            return
        metrics.CACHE_STORES.labels("stored").inc()
        STORE_FAILURES.ended(STORES)

    async def _store_batch(
        self, request: cache_pb2.StoreBatchRequest
    ) -> cache_pb2.StoreBatchResponse | None:
        """One StoreBatch call; None where the cache predates it (UNIMPLEMENTED)."""
        stub = self.cache.stub()

        async def store_batch(batch: Any, **kwargs: Any) -> Any:
            try:
                return await stub.StoreBatch(batch, **kwargs)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return None
                raise

        reply: cache_pb2.StoreBatchResponse | None = await call_hop(
            schema.SPAN_CACHE_STORE, self.cache.target, store_batch, request, WRITE_TIMEOUT_S, {}
        )
        return reply

    async def _store_each(self, requests: Sequence[cache_pb2.StoreRequest]) -> None:
        """A cache from before StoreBatch (a rolling upgrade): these stores, and the next
        ones for a while, go by Store."""
        if time.monotonic() >= self._unary_until:
            log.info("the cache has no StoreBatch; storing one by one for a minute")
        self._unary_until = time.monotonic() + UNARY_FALLBACK_S
        await asyncio.gather(*(self._store_alone(r) for r in requests))


def spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
    """A task kept in `tasks` until it is done (asyncio holds only weak references)."""
    task = asyncio.create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
