"""Dynamic batching: the same answers as runs alone, in order, failures and overload contained.

In process (the model runs on onnxruntime here); the inference service's own queue bound, over
gRPC, is tests/mesh/test_batching_service.py."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from conftest import BATCH_TEXTS, DEFAULT_MODEL
from hopline.model.repository import load_config
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.runtime.batching import BatchInfo, BatchingPolicy, DynamicBatcher, QueueFullError
from hopline.runtime.fairness import FLOW
from hopline.services.inference.backend import Array, OnnxRuntimeBackend
from hopline.services.inference.batched_model import BatchedModel, ModelRequest, NeverFitsError


def _requests(repo: Path) -> tuple[OnnxRuntimeBackend, list[ModelRequest]]:
    cfg = load_config(repo / DEFAULT_MODEL / "1")
    tokenizer = load_tokenizer(cfg.file("tokenizer"), cfg.max_sequence_length)
    backend = OnnxRuntimeBackend(cfg, threads=1)
    requests = []
    for text in BATCH_TEXTS:
        batch = encode(tokenizer, [text])
        inputs: dict[str, Array] = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
        }
        requests.append(ModelRequest(inputs, (), 1, int(batch.input_ids.shape[1])))
    # Two 3-row requests: rows of one request must stay together and in order.
    for first in (0, 6):
        batch = encode(tokenizer, BATCH_TEXTS[first : first + 3])
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        requests.append(ModelRequest(inputs, ("logits",), 3, int(batch.input_ids.shape[1])))
    return backend, requests


def test_batched_results_match_runs_alone_in_order(default_repo: Path) -> None:
    """Every request's outputs equal its own run alone (1e-5), labels identical, rows in order.

    Requests of different lengths share the one length bucket below 16 tokens, so they are
    padded together; the two longer ones land in the next bucket.
    """
    backend, requests = _requests(default_repo)
    alone: list[dict[str, npt.NDArray[Any]]] = [
        backend.run(r.inputs, list(r.outputs)) for r in requests
    ]

    async def together() -> tuple[list[dict[str, Any]], BatchedModel]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            model = BatchedModel(backend, executor, max_in_flight=1)
            try:
                results = await asyncio.gather(*(model.infer(r) for r in requests))
            finally:
                await model.close()
        return [outputs for outputs, _ in results], model

    batched, model = asyncio.run(together())
    # With one run at a time, the first request runs alone and the rest queue behind it.
    assert model.batcher.batches < len(requests), "nothing was batched"
    assert model.batcher.rows == sum(r.rows for r in requests)
    for request, mine, reference in zip(requests, batched, alone, strict=True):
        assert set(mine) == set(reference)
        for name, value in reference.items():
            assert mine[name].shape == value.shape, name
            np.testing.assert_allclose(mine[name], value, atol=1e-5, rtol=0)
        labels = np.argmax(mine["logits"], axis=1)
        assert labels.tolist() == np.argmax(reference["logits"], axis=1).tolist()
        assert mine["logits"].shape[0] == request.rows


async def behind_a_held_run(
    run: Callable[[list[str]], Sequence[str]],
    gate: threading.Event,
    workers: int,
    short: tuple[str, str],
    long: tuple[str, str],
) -> list[Any]:
    """A "hold" run takes the one run slot until `gate` is set; meanwhile two requests of
    8 tokens queue, then two of 40 (another length bucket). Each request's output, or its
    exception, in that order."""
    with ThreadPoolExecutor(max_workers=workers) as executor:
        batcher: DynamicBatcher[str, str] = DynamicBatcher(
            run, BatchingPolicy(length_buckets=(16, 64), max_in_flight=1), executor
        )
        hold = asyncio.ensure_future(batcher.submit("hold", length=4))
        await asyncio.sleep(0.05)  # the holding run occupies the only slot
        first = [asyncio.ensure_future(batcher.submit(t, length=8)) for t in short]
        await asyncio.sleep(0.01)
        second = [asyncio.ensure_future(batcher.submit(t, length=40)) for t in long]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(hold, *first, *second, return_exceptions=True)
        await batcher.close()
        return [r if isinstance(r, BaseException) else r[0] for r in results]


def held_run(runs: list[list[str]], gate: threading.Event, payloads: list[str]) -> None:
    """A stand-in model run's start: the batch recorded, a batch holding "hold" kept until
    `gate` is set."""
    runs.append(list(payloads))
    if "hold" in payloads:
        gate.wait(10)


def test_a_failed_batch_fails_only_the_request_that_fails_alone() -> None:
    """A run that raises is run again request by request: only the request that fails alone
    fails; its batch-mate and the batch beside it are answered.

    The run function here is a stand-in for a model so the test decides which request fails;
    the scheduler under test is the one the inference service uses.
    """
    gate = threading.Event()
    runs: list[list[str]] = []

    def run(payloads: list[str]) -> Sequence[str]:
        held_run(runs, gate, payloads)
        if "poison" in payloads:
            raise RuntimeError("model run failed")
        return [p.upper() for p in payloads]

    hold, a, b, poison, c = asyncio.run(
        behind_a_held_run(run, gate, 1, ("a", "b"), ("poison", "c"))
    )
    assert (hold, a, b, c) == ("HOLD", "A", "B", "C")
    assert isinstance(poison, RuntimeError)
    assert ["poison", "c"] in runs  # together first, then each alone
    assert runs[-2:] == [["poison"], ["c"]]


def test_the_runs_again_of_a_failed_batch_keep_to_the_run_slots() -> None:
    """With one run slot and four executor threads, a failed shared run's requests run again
    one by one in that slot while another batch waits: never two runs at once."""
    gate = threading.Event()
    lock = threading.Lock()
    running = [0, 0]  # now, most at once
    runs: list[list[str]] = []

    def run(payloads: list[str]) -> Sequence[str]:
        with lock:
            running[0] += 1
            running[1] = max(running)
            runs.append(list(payloads))
        try:
            if "hold" in payloads:
                gate.wait(10)
            threading.Event().wait(0.02)  # long enough for a second run to overlap
            if "poison" in payloads:
                raise RuntimeError("model run failed")
            return [p.upper() for p in payloads]
        finally:
            with lock:
                running[0] -= 1

    # ("poison", "a") is older than ("b", "c"): dispatched first, ("b", "c") waits.
    scenario = behind_a_held_run(run, gate, 4, ("poison", "a"), ("b", "c"))
    hold, poison, a, b, c = asyncio.run(scenario)
    assert (hold, a, b, c) == ("HOLD", "A", "B", "C")
    assert isinstance(poison, RuntimeError)
    assert runs == [["hold"], ["poison", "a"], ["poison"], ["a"], ["b", "c"]]
    assert running[1] == 1


async def _holding(
    gate: threading.Event, executor: ThreadPoolExecutor, **options: Any
) -> tuple[DynamicBatcher[str, str], asyncio.Future[tuple[str, BatchInfo]]]:
    """A batcher (`options`: its policy's, and `on_queue_depth`) whose one run slot holds
    "x" until `gate` is set."""
    depth = options.pop("on_queue_depth", None)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(
        lambda p: (gate.wait(10), p)[1], BatchingPolicy(**options), executor, on_queue_depth=depth
    )
    running = asyncio.ensure_future(batcher.submit("x"))
    await asyncio.sleep(0.05)
    return batcher, running


def test_queue_bound_is_enforced_in_the_batcher() -> None:
    async def scenario() -> None:
        gate = threading.Event()
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher, running = await _holding(gate, executor, max_queue_size=3)
            queued = asyncio.ensure_future(batcher.submit("y", rows=3))
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError, match="max_queue_size 3"):
                await batcher.submit("z")
            gate.set()
            assert (await running)[0] == "x"
            assert (await queued)[0] == "y"
            await batcher.close()

    asyncio.run(scenario())


def _as_tenant(tenant: str, work: Any) -> asyncio.Task[Any]:
    """`work` (a coroutine) in a task of its own running as `tenant`'s flow, as the gateway's
    admission sets it for a request."""
    context = contextvars.copy_context()
    context.run(FLOW.set, tenant)
    return asyncio.get_running_loop().create_task(work, context=context)


def _two_buckets(
    runs: list[list[str]], gate: threading.Event, executor: ThreadPoolExecutor
) -> DynamicBatcher[str, str]:
    """Runs of at most 4 rows, one at a time, in two length buckets (up to 16 and 64 tokens),
    each recorded (`held_run`)."""

    def run(payloads: list[str]) -> Sequence[str]:
        held_run(runs, gate, payloads)
        return payloads

    policy = BatchingPolicy(max_batch_size=4, length_buckets=(16, 64), max_in_flight=1)
    return DynamicBatcher(run, policy, executor)


def test_a_tenant_behind_another_tenants_backlog_runs_in_the_next_batch() -> None:
    """One tenant's 30 requests queue behind a held run, then another tenant's one: it runs
    in the first batch after the held run, not after the whole backlog (it was in the last of
    eight batches when the batcher served arrival order). Lengths in two buckets, so the
    choice between buckets is fair too; the flood's own rows keep their arrival order."""
    gate = threading.Event()
    runs: list[list[str]] = []

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = _two_buckets(runs, gate, executor)
            hold = _as_tenant("flood", batcher.submit("hold", length=4))
            await asyncio.sleep(0.05)
            flood = [
                _as_tenant("flood", batcher.submit(f"f{i}", length=8 if i % 2 else 40))
                for i in range(30)
            ]
            await asyncio.sleep(0.01)
            other = _as_tenant("other", batcher.submit("other", length=40))
            await asyncio.sleep(0.01)
            gate.set()
            await asyncio.gather(hold, *flood, other)
            await batcher.close()

    asyncio.run(scenario())
    assert runs[0] == ["hold"]
    assert "other" in runs[1]
    served = [p for r in runs[1:] for p in r if p != "other"]
    short = [p for p in served if int(p[1:]) % 2]
    assert short == sorted(short, key=lambda p: int(p[1:]))
    assert sorted(served) == sorted(f"f{i}" for i in range(30))


def test_tenants_with_one_request_each_are_served_oldest_first_across_lengths() -> None:
    """Every waiting tenant with one request (the usual case: a caller a tenant) ties in fair
    order; the tie went to the shortest length bucket, so a tenant of long texts waited behind
    every short one as long as they kept coming (a helper's probe: one answer in 3 s beside 8
    tenants of short texts, 49 with arrival order). The oldest goes first."""
    gate = threading.Event()
    runs: list[list[str]] = []

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = _two_buckets(runs, gate, executor)
            hold = _as_tenant("h", batcher.submit("hold", length=4))
            await asyncio.sleep(0.05)
            long = _as_tenant("long-texts", batcher.submit("long", length=40))
            await asyncio.sleep(0.01)
            short = [_as_tenant(f"s{i}", batcher.submit(f"s{i}", length=8)) for i in range(4)]
            await asyncio.sleep(0.01)
            gate.set()
            await asyncio.gather(hold, long, *short)
            await batcher.close()

    asyncio.run(scenario())
    assert runs == [["hold"], ["long"], ["s0", "s1", "s2", "s3"]]


def test_requests_given_up_behind_a_backlog_free_the_queue_bound() -> None:
    """A caller that gave up leaves its request queued until the scheduler reaches it; at
    the queue's bound those are dropped before a new request is refused."""

    async def scenario() -> None:
        gate = threading.Event()
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher, running = await _holding(gate, executor, max_queue_size=3)
            gone = [asyncio.ensure_future(batcher.submit(t)) for t in ("a", "b", "c")]
            await asyncio.sleep(0)
            for task in gone[1:]:
                task.cancel()
            queued = asyncio.ensure_future(batcher.submit("y", rows=2))
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError, match="max_queue_size 3"):
                await batcher.submit("z")
            gate.set()
            assert [(await t)[0] for t in (running, gone[0], queued)] == ["x", "a", "y"]
            await batcher.close()

    asyncio.run(scenario())


def test_the_queue_depth_returns_to_zero_when_every_waiting_caller_gave_up() -> None:
    """`hopline_queue_depth` read 1-15 rows on an idle model after callers gave up in a flood
    (a helper's probe): requests dropped from the queue were never said, and a lone request
    that runs at once says nothing."""
    depths: list[int] = []
    gate = threading.Event()

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher, running = await _holding(gate, executor, on_queue_depth=depths.append)
            gone = [asyncio.ensure_future(batcher.submit(t)) for t in ("a", "b", "c")]
            await asyncio.sleep(0)
            assert depths[-1] == 3
            for task in gone:
                task.cancel()
            await asyncio.sleep(0)
            gate.set()
            await running
            await batcher.wait_idle()
            assert (await batcher.submit("alone"))[0] == "alone"
            await batcher.close()

    asyncio.run(scenario())
    assert depths[-1] == 0, depths


def test_a_lone_request_that_gives_up_mid_run_holds_its_slot_until_the_run_ends() -> None:
    """A lone request runs from its caller's task; when that caller is cancelled mid-run the
    model is still busy, so the next request must queue, not start a second run beside it."""
    started, gate = threading.Event(), threading.Event()

    def run(payloads: list[str]) -> Sequence[str]:
        started.set()
        gate.wait(10)
        return [p.upper() for p in payloads]

    async def scenario() -> tuple[int, str]:
        with ThreadPoolExecutor(max_workers=2) as executor:  # room for a second run
            batcher: DynamicBatcher[str, str] = DynamicBatcher(run, BatchingPolicy(), executor)
            first = asyncio.ensure_future(batcher.submit("a"))
            assert await asyncio.to_thread(started.wait, 5)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            second = asyncio.ensure_future(batcher.submit("b"))
            await asyncio.sleep(0.05)
            waiting = batcher.waiting_rows  # 1: queued behind the abandoned run
            gate.set()
            output, _ = await second
            await batcher.close()
            return waiting, output

    assert asyncio.run(scenario()) == (1, "B")


def _ten_rows(backend: OnnxRuntimeBackend) -> ModelRequest:
    tokenizer = load_tokenizer(backend.config.file("tokenizer"), 256)
    batch = encode(tokenizer, BATCH_TEXTS[:10])
    inputs: dict[str, Array] = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
    }
    return ModelRequest(inputs, (), 10, int(batch.input_ids.shape[1]))


def _small_runs(backend: OnnxRuntimeBackend, rows: int, queue: int) -> None:
    """The backend's version taking at most `rows` rows a run and `queue` waiting rows."""
    batching = dataclasses.replace(
        backend.config.batching, max_batch_size=rows, max_queue_size=queue
    )
    backend.config = dataclasses.replace(backend.config, batching=batching)


@contextlib.asynccontextmanager
async def _recorded(
    backend: OnnxRuntimeBackend, slots: int = 1
) -> AsyncIterator[tuple[BatchedModel, list[int]]]:
    """`backend` as a served model with `slots` run slots, and the rows of each run it makes."""
    with ThreadPoolExecutor(max_workers=slots) as executor:
        model = BatchedModel(backend, executor, max_in_flight=slots)
        sizes: list[int] = []
        model.batcher._on_batch = sizes.append
        try:
            yield model, sizes
        finally:
            await model.close()


def _first_rows(request: ModelRequest, rows: int) -> ModelRequest:
    inputs = {name: a[:rows] for name, a in request.inputs.items()}
    return dataclasses.replace(request, inputs=inputs, rows=rows)


def test_a_request_larger_than_a_run_runs_in_parts_with_the_same_answers(
    default_repo: Path,
) -> None:
    """Ten rows where a run takes four: three runs (4, 4, 2), side by side in the slots, and
    the outputs of one run of all ten, in order."""
    backend, _ = _requests(default_repo)
    request = _ten_rows(backend)
    whole: dict[str, npt.NDArray[Any]] = backend.run(request.inputs, [])
    _small_runs(backend, rows=4, queue=64)

    async def in_parts() -> tuple[dict[str, Any], BatchInfo, list[int]]:
        async with _recorded(backend, slots=3) as (model, sizes):
            outputs, info = await model.infer(request)
        return outputs, info, sizes

    outputs, info, sizes = asyncio.run(in_parts())
    assert sorted(sizes) == [2, 4, 4]
    assert info.rows == 4
    assert set(outputs) == set(whole)
    for name, value in whole.items():
        assert outputs[name].shape == value.shape, name
        np.testing.assert_allclose(outputs[name], value, atol=1e-5, rtol=0)


def test_a_request_whose_part_is_refused_leaves_no_part_queued(default_repo: Path) -> None:
    """Parts are queued one by one; when the queue refuses one (here: behind a lone request
    holding the run slot), the request is refused (QueueFullError: RESOURCE_EXHAUSTED at the
    service) and its parts still waiting never run."""
    backend, _ = _requests(default_repo)
    request = _ten_rows(backend)
    lone = _first_rows(request, 2)
    _small_runs(backend, rows=4, queue=6)

    async def refused() -> tuple[int, list[int]]:
        async with _recorded(backend) as (model, sizes):
            first = asyncio.ensure_future(model.infer(lone))
            await asyncio.sleep(0)  # it takes the one run slot
            with pytest.raises(QueueFullError):
                await model.infer(request)
            await first
            await asyncio.sleep(0.1)  # the scheduler lets go of the cancelled parts
            return model.batcher.waiting_rows, sizes

    waiting, sizes = asyncio.run(refused())
    assert waiting == 0
    assert sizes == [2]  # the lone request's run; no part of the refused one ran


def test_a_request_the_model_never_holds_at_once_is_the_clients_to_split(
    default_repo: Path,
) -> None:
    """Ten rows against runs of 4 and 4 waiting rows: refused on any load, so NeverFitsError
    (INVALID_ARGUMENT at the service) naming the most a request may carry, before any part
    runs; it was QueueFullError, which the service told the client to retry."""
    backend, _ = _requests(default_repo)
    request = _ten_rows(backend)
    _small_runs(backend, rows=4, queue=4)

    async def refused() -> tuple[str, list[int]]:
        async with _recorded(backend) as (model, sizes):
            with pytest.raises(NeverFitsError) as refusal:
                await model.infer(request)
            outputs, _ = await model.infer(_first_rows(request, 8))  # one run, 4 waiting
            assert next(iter(outputs.values())).shape[0] == 8
            return str(refusal.value), sizes

    said, sizes = asyncio.run(refused())
    assert "10 rows in one request" in said
    assert "send at most 8 rows a request" in said
    assert sorted(sizes) == [4, 4]


def test_a_request_more_than_the_queue_bound_runs_when_the_model_is_free() -> None:
    """20 rows beside max_queue_size 1 were refused on an idle model and told to retry (a
    model author's probe): a request that runs at once never waits, so the bound on waiting
    rows is not its. Behind a busy run slot it is refused, saying how to fit."""

    async def scenario() -> tuple[str, str]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            free: DynamicBatcher[str, str] = DynamicBatcher(
                lambda p: p, BatchingPolicy(max_queue_size=1), executor
            )
            output, _ = await free.submit("big", rows=3)
            gate = threading.Event()
            busy, running = await _holding(gate, executor, max_queue_size=1)
            with pytest.raises(QueueFullError) as refusal:
                await busy.submit("big", rows=3)
            gate.set()
            await running
            await asyncio.gather(free.close(), busy.close())
            return output, str(refusal.value)

    output, said = asyncio.run(scenario())
    assert output == "big"
    assert "send at most 1 rows a request to be queued" in said


def test_a_retired_batcher_closes_once_idle_and_still_answers_a_late_request() -> None:
    """What the inference service does with a model version removed from the repository:
    wait_idle returns only once the queued and running requests are answered, and a request
    that took the model just before close runs alone instead of waiting on no scheduler."""
    gate = threading.Event()

    def run(payloads: list[str]) -> Sequence[str]:
        if "hold" in payloads:
            gate.wait(10)
        return [p.upper() for p in payloads]

    async def scenario() -> tuple[bool, list[str], str]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            # A policy that holds a lone request back for company: it would queue.
            policy = BatchingPolicy(max_in_flight=1, max_queue_delay_us=1000)
            batcher: DynamicBatcher[str, str] = DynamicBatcher(run, policy, executor)
            busy = [asyncio.ensure_future(batcher.submit(t)) for t in ("hold", "queued")]
            idle = asyncio.ensure_future(batcher.wait_idle())
            await asyncio.sleep(0.05)
            waited = not idle.done()  # a run holds the slot and a request waits
            gate.set()
            await idle
            answers = [output for output, _ in await asyncio.gather(*busy)]
            await batcher.close()
            late, _ = await asyncio.wait_for(batcher.submit("late"), 5)
            return waited, answers, late

    assert asyncio.run(scenario()) == (True, ["HOLD", "QUEUED"], "LATE")
