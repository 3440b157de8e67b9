"""Dynamic batching: requests that wait together run together, bucketed by length.

One implementation serves the inference service, the cache's embedder and the in-process
baseline of `hopline bench`, so what the benchmark compares against is the same scheduler.

Scheduling, per batcher:
- A request goes into the bucket of its sequence length (`length_buckets` are upper bounds
  in tokens), so a 9-token query is never padded to a 200-token one.
- When a run slot is free, the bucket holding the next request in fair order is dispatched:
  up to `max_batch_size` rows in that order. Fair order (runtime/fairness.py) is arrival
  order while one tenant sends; while several do, each gets an equal share of the rows run,
  so one tenant's backlog does not queue the others behind it. With `max_queue_delay_us` > 0
  a batch that is not full waits up to that long after the request at its head arrived for
  more rows; with 0 (the default) nothing waits: a lone request runs at once (from its caller's
  task, not through the scheduler: two event-loop turns fewer), and under load the requests
  that queued while the previous run was busy form the next batch.
- Past `max_queue_size` waiting rows a request is refused at once (QueueFullError), so an
  overloaded model answers RESOURCE_EXHAUSTED instead of letting every queue in front of it
  grow.
- A failed run fails only the requests in that batch; a cancelled request (its RPC gave
  up) is dropped from the queue and never runs.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

from hopline.runtime.fairness import FLOW, FairQueue, VirtualClock

In = TypeVar("In")
Out = TypeVar("Out")

DEFAULT_BUCKETS = (16, 32, 64, 128, 256)
DEFAULT_MAX_BATCH = 32
# Past a second a request's wait for company is a deadline, not a batching delay: a config's
# 1e12 made a lone request wait until its caller gave up (a helper's probe).
MAX_QUEUE_DELAY_US = 1_000_000


class QueueFullError(Exception):
    """The batcher's queue is at its bound; the caller should shed the request."""


@dataclasses.dataclass(frozen=True)
class BatchingPolicy:
    max_batch_size: int = DEFAULT_MAX_BATCH
    max_queue_delay_us: int = 0
    length_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_queue_size: int = 1024
    # Runs at once. One by default: ONNX Runtime already spreads a run over the cores.
    max_in_flight: int = 1

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_queue_size < 1 or self.max_in_flight < 1:
            raise ValueError("max_batch_size, max_queue_size and max_in_flight must be >= 1")
        if not 0 <= self.max_queue_delay_us <= MAX_QUEUE_DELAY_US:
            raise ValueError(f"max_queue_delay_us must be from 0 to {MAX_QUEUE_DELAY_US}")
        buckets = tuple(self.length_buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError("length_buckets must be increasing positive token counts")

    @classmethod
    def from_json(cls, raw: dict[str, Any], model_max_batch_size: int) -> BatchingPolicy:
        """The `dynamic_batching` block of a model's config.json (every key optional).

        Runs in flight are not a model property but a deployment one (the inference
        service's `--workers`), so the block does not set them.
        """
        if not isinstance(raw, dict):
            raise ValueError("dynamic_batching must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)} - {"max_in_flight"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(
                f"unknown dynamic_batching keys {sorted(unknown)} (known: {sorted(known)})"
            )
        # Whole numbers, checked before any comparison: a float max_batch_size loaded and
        # failed every batched run (TypeError, INTERNAL to clients), a string one failed the
        # load naming no key (a helper's probe).
        for key, value in raw.items():
            listed = key == "length_buckets"
            if not (
                isinstance(value, list) and value and all(_whole(b) for b in value)
                if listed
                else _whole(value)
            ):
                kind = "a list of whole numbers" if listed else "a whole number"
                got = json.dumps(value)[:60]
                raise ValueError(f"dynamic_batching.{key} must be {kind}, got {got}")
        # 32 rows: on 2 CPU cores a 32-row MiniLM run already gets 96% of the per-row saving
        # of a 64-row one (1.46 vs 1.40 ms a row) in half the time a request waits for it.
        values = {"max_batch_size": min(DEFAULT_MAX_BATCH, model_max_batch_size), **raw}
        if values["max_batch_size"] > model_max_batch_size:
            raise ValueError(
                f"dynamic_batching.max_batch_size {values['max_batch_size']} exceeds the "
                f"model's max_batch_size {model_max_batch_size}"
            )
        if "length_buckets" in values:
            values["length_buckets"] = tuple(values["length_buckets"])
        return cls(**values)


def _whole(value: Any) -> bool:
    """A JSON whole number (JSON's true is Python's 1: not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """How a request was run, for its spans and timings."""

    enqueued_ns: int
    started_ns: int
    finished_ns: int
    rows: int  # rows in the whole run


@dataclasses.dataclass(eq=False)
class _Item(Generic[In, Out]):
    payload: In
    rows: int
    enqueued_ns: int
    future: asyncio.Future[tuple[Out, BatchInfo]]


def _fail(item: _Item[Any, Any], exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


class DynamicBatcher(Generic[In, Out]):
    """Batches `submit` calls into calls of `run(payloads) -> outputs` on `executor`.

    `run` is blocking and gets the payloads of one batch, in fair order (arrival order for
    one tenant's); it returns one output per payload in the same order. It runs on
    `executor`, off the event loop.
    """

    def __init__(
        self,
        run: Callable[[list[In]], Sequence[Out]],
        policy: BatchingPolicy,
        executor: Executor,
        *,
        on_queue_depth: Callable[[int], None] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._run = run
        self.policy = policy
        self._executor = executor
        # One virtual clock: the buckets share the run slots, so the shares are the batcher's.
        clock = VirtualClock()
        self._buckets: list[FairQueue[_Item[In, Out]]] = [
            FairQueue(clock) for _ in policy.length_buckets
        ]
        self._waiting_rows = 0
        self._in_flight = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._runs: set[asyncio.Future[Any]] = set()
        self._closed = False
        self._ran = asyncio.Event()  # set whenever a run ends: wait_idle's wake-up
        self._on_queue_depth = on_queue_depth or (lambda _: None)
        self._on_batch = on_batch or (lambda _: None)
        self.batches = 0
        self.rows = 0

    @property
    def waiting_rows(self) -> int:
        return self._waiting_rows

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return self._waiting_rows == 0 and self._in_flight == 0

    async def wait_idle(self) -> None:
        """Until nothing waits and nothing runs (idle only ever begins as a run ends)."""
        while not self.idle:
            self._ran.clear()
            await self._ran.wait()

    def bucket_of(self, length: int) -> int:
        """Index of the smallest bucket that holds `length` tokens (longer: the last)."""
        index = bisect.bisect_left(self.policy.length_buckets, length)
        return min(index, len(self._buckets) - 1)

    async def submit(self, payload: In, rows: int = 1, length: int = 1) -> tuple[Out, BatchInfo]:
        """Queue `payload` (`rows` rows of `length` tokens) and wait for its output."""
        # A request that runs at once never waits, so the bound on waiting rows is not its
        # (20 rows beside max_queue_size 1 were refused on an idle model, told to retry).
        runs_now = self._closed or self._alone_runs_now(rows)
        if (
            not runs_now
            and self._waiting_rows + rows > self.policy.max_queue_size
            and not self._pruned(rows)
        ):
            raise QueueFullError(self._full(rows))
        # After close (a retired model version), a request that took the model just before
        # runs alone rather than wait on a scheduler that is gone.
        if runs_now or self._alone_runs_now(rows):
            return await self._run_alone(payload, rows)
        if self._task is None:
            self._task = asyncio.create_task(self._schedule(), name="loop-batcher")
        item: _Item[In, Out] = _Item(
            payload, rows, time.time_ns(), asyncio.get_running_loop().create_future()
        )
        self._buckets[self.bucket_of(length)].push(item, FLOW.get(), rows)
        self._waiting_rows += rows
        self._on_queue_depth(self._waiting_rows)
        self._wake.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            item.future.cancel()  # the scheduler skips it if it has not run yet
            raise

    def _full(self, rows: int) -> str:
        bound = self.policy.max_queue_size
        said = f"{self._waiting_rows} rows already waiting (max_queue_size {bound})"
        if rows > bound:
            said += (
                f"; a request of {rows} rows, more than may wait, is taken only while the "
                f"model is free: send at most {bound} rows a request to be queued"
            )
        return said

    def _pruned(self, rows: int) -> bool:
        """Whether `rows` more fit once the requests whose callers gave up are dropped (they
        count until the scheduler reaches them, which may be behind a flood's rows)."""
        for bucket in self._buckets:
            self._waiting_rows -= sum(i.rows for i in bucket.prune(lambda i: i.future.done()))
        self._on_queue_depth(self._waiting_rows)
        return self._waiting_rows + rows <= self.policy.max_queue_size

    def _alone_runs_now(self, rows: int) -> bool:
        """Nothing waits, a run slot is free and the policy would not hold the request back
        for company: the scheduler would run it next, alone, so it runs here."""
        waits_for_company = self.policy.max_queue_delay_us > 0 and rows < self.policy.max_batch_size
        return (
            self._waiting_rows == 0
            and self._in_flight < self.policy.max_in_flight
            and not waits_for_company
        )

    async def _run_alone(self, payload: In, rows: int) -> tuple[Out, BatchInfo]:
        self._in_flight += 1
        (output,), started, finished = await self._execute([payload], rows)
        return output, BatchInfo(started, started, finished, rows)

    async def _execute(self, payloads: list[In], rows: int) -> tuple[Sequence[Out], int, int]:
        """One run on the executor, in a slot already taken: (outputs, started, finished).
        The slot is given back when the run ends, even when its awaiting task is cancelled
        first (a second run must not start beside one still going)."""
        self._on_batch(rows)
        started = time.time_ns()
        job = self._executor.submit(self._run, payloads)
        try:
            outputs = await asyncio.wrap_future(job)
        finally:
            if job.done():
                self._release()
            else:  # given up mid-run: the slot stays taken until the run ends
                loop = asyncio.get_running_loop()
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        if len(outputs) != len(payloads):
            raise RuntimeError(f"batch run returned {len(outputs)} outputs for {len(payloads)}")
        self.batches += 1
        self.rows += rows
        return outputs, started, time.time_ns()

    def _release(self) -> None:
        self._in_flight -= 1
        self._wake.set()
        self._ran.set()

    def _next_bucket(self) -> FairQueue[_Item[In, Out]] | None:
        waiting = self._waiting_rows
        for bucket in self._buckets:  # drop requests whose callers gave up
            while bucket and bucket.head().future.done():
                self._waiting_rows -= bucket.pop(served=False).rows
        if self._waiting_rows != waiting:
            # Said now: the queue may be empty from here on, and a lone request that runs at
            # once says nothing (a helper's probe read 12 rows waiting on an idle model).
            self._on_queue_depth(self._waiting_rows)
        live = [b for b in self._buckets if b]
        # Tags tie whenever each waiting tenant has one request (the common case: one caller
        # a tenant): then the oldest goes first. Ties went to the shortest bucket, and a
        # tenant of long texts waited behind every short one (a helper's probe: 1 answer in
        # 3 s beside 8 tenants of short texts, 49 before).
        return min(live, key=lambda b: (b.head_tag(), b.head().enqueued_ns)) if live else None

    def _take(self, bucket: FairQueue[_Item[In, Out]]) -> list[_Item[In, Out]]:
        batch: list[_Item[In, Out]] = []
        rows = 0
        while bucket:
            # A request larger than max_batch_size (the model may allow more) runs alone.
            if batch and rows + bucket.head().rows > self.policy.max_batch_size:
                break
            live = not bucket.head().future.done()
            item = bucket.pop(served=live)
            self._waiting_rows -= item.rows
            if live:
                batch.append(item)
                rows += item.rows
        self._on_queue_depth(self._waiting_rows)
        return batch

    async def _schedule(self) -> None:
        delay_ns = self.policy.max_queue_delay_us * 1000
        while True:
            bucket = self._next_bucket()
            if bucket is None or self._in_flight >= self.policy.max_in_flight:
                self._wake.clear()
                await self._wake.wait()
                continue
            if delay_ns:
                rows = sum(i.rows for i in bucket)
                due = bucket.head().enqueued_ns + delay_ns
                if rows < self.policy.max_batch_size and time.time_ns() < due:
                    # Wait for more rows, a fuller bucket or the deadline, whichever is first.
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), (due - time.time_ns()) / 1e9)
                    continue
            batch = self._take(bucket)
            if batch:
                self._in_flight += 1
                run = asyncio.ensure_future(self._run_batch(batch))
                self._runs.add(run)
                run.add_done_callback(self._runs.discard)

    async def _run_batch(self, batch: list[_Item[In, Out]]) -> None:
        rows = sum(i.rows for i in batch)
        try:
            outputs, started, finished = await self._execute([i.payload for i in batch], rows)
        except Exception as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
                return
            # One request can fail a run it shares (a value the model refuses): each runs
            # again alone, so a failure reaches only the requests that cause it.
            try:
                for item in batch:
                    if not item.future.done():
                        self._in_flight += 1  # a slot per run again, given back when it ends
                        await self._run_batch([item])
            finally:  # cancelled part-way: the rest hear the batch's failure
                for item in batch:
                    _fail(item, exc)
            return
        for item, output in zip(batch, outputs, strict=True):
            if not item.future.done():
                info = BatchInfo(item.enqueued_ns, started, finished, rows)
                item.future.set_result((output, info))

    async def close(self) -> None:
        """Stop scheduling, let running batches finish, and cancel what still waits."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._runs:
            await asyncio.wait(set(self._runs))
        for bucket in self._buckets:
            for item in bucket.clear():
                item.future.cancel()
        self._waiting_rows = 0
