"""gateway/catalogue.py: a model list that cannot be read again is said once, not silently,
and a request naming a version the gateway has not heard of is told NOT_FOUND only when a
list read after it says so.

Stand-in: the inference pool's stub is an object of the test's that answers ListModels as the
test says (the mesh tests run the real inference service; a ListModels that fails for a
minute on end is the case here, one warning and one line when it is over)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
import pytest

from hopline.gateway import catalogue as catalogue_module
from hopline.gateway.catalogue import REREAD_MIN_S, ModelCatalogue
from hopline.gateway.errors import RequestError
from hopline.observability.logs import QUIET_S
from hopline.protos.hopline.inference.v1 import inference_pb2

LISTED = inference_pb2.ListModelsResponse(
    models=[inference_pb2.ModelInfo(name="intents", version="1", ready=True)]
)


class Inference:
    """The pool and its stub: ListModels answers LISTED, or fails with `failing`."""

    def __init__(self) -> None:
        self.failing: grpc.StatusCode | None = None
        self.listed = LISTED
        self.calls = 0
        self.slow = asyncio.Event()  # cleared: ListModels waits for it (a version loading)
        self.slow.set()

    def target(self) -> str:
        return "inference"

    def stub(self) -> Inference:
        return self

    async def ListModels(self, request: Any, **_: Any) -> Any:
        self.calls += 1
        await self.slow.wait()
        if self.failing is not None:
            raise grpc.aio.AioRpcError(
                self.failing, grpc.aio.Metadata(), grpc.aio.Metadata(), "it failed", None
            )
        return self.listed

    async def close(self) -> None:
        return None


def test_a_model_list_that_fails_after_one_was_read_is_said_once_and_when_it_is_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="hopline.gateway.catalogue")
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]

    async def run() -> None:
        inference.failing = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError):
            await catalogue.refresh()  # before any list: the start-up wait says it, not this
        inference.failing = None
        await catalogue.refresh()
        inference.failing = grpc.StatusCode.UNKNOWN
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError):
                await catalogue.refresh()
        assert ("intents", "1") in catalogue.models  # the list read before still serves
        await asyncio.sleep(QUIET_S)
        inference.failing = None
        await catalogue.refresh()

    asyncio.run(run())
    said = [r for r in caplog.records if r.name == "hopline.gateway.catalogue"]
    failed = [r for r in said if r.getMessage().startswith("reading the model list failed")]
    assert [r.getMessage() for r in failed] == [
        "reading the model list failed; serving the list read before",
        "reading the model list failed; serving the list read before: over",
    ]
    assert failed[0].status == "UNKNOWN"  # type: ignore[attr-defined]
    assert failed[1].failures == 20  # type: ignore[attr-defined]


TWO = inference_pb2.ListModelsResponse(
    models=[
        inference_pb2.ModelInfo(name="intents", version="1", ready=True),
        inference_pb2.ModelInfo(name="intents", version="2", ready=True),
    ]
)


def test_a_new_version_waits_for_a_slow_list_and_only_a_read_list_says_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inference loads a new version before it lists it: under load longer than the 5 s the
    gateway used to allow its ListModels, and the version's first request got NOT_FOUND. A
    request waits for the read up to its own deadline (DEADLINE_EXCEEDED past it, the read
    going on for the others); a read that fails is UNAVAILABLE, not NOT_FOUND. (Reads one
    after another here: no spacing, see the next test.)"""
    monkeypatch.setattr(catalogue_module, "REREAD_MIN_S", 0.0)
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]

    async def run() -> None:
        await catalogue.refresh()
        inference.slow.clear()  # version 2 loading
        inference.listed = TWO
        with pytest.raises(RequestError) as late:
            await catalogue.resolve("intents", "2", 0.05)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "'intents/2'" in late.value.message
        inference.slow.set()
        await asyncio.sleep(0.05)
        # The caller's deadline did not cancel the read it started: it ended, and was kept.
        assert ("intents", "2") in catalogue.models
        assert (await catalogue.resolve("intents", "2", 5.0)).version == "2"
        assert inference.calls == 2

        inference.failing = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(RequestError) as unread:
            await catalogue.resolve("intents", "3", 5.0)
        assert unread.value.code == grpc.StatusCode.UNAVAILABLE
        assert "could not be read again (UNAVAILABLE)" in unread.value.message
        inference.failing = None
        with pytest.raises(RequestError) as absent:
            await catalogue.resolve("intents", "3", 5.0)
        assert absent.value.code == grpc.StatusCode.NOT_FOUND
        assert "serving: intents/1, intents/2" in absent.value.message
        assert (await catalogue.resolve("intents", "", 5.0)).version == "2"

    asyncio.run(run())


def test_requests_for_unknown_models_share_reads_at_most_one_per_spacing() -> None:
    """Each request for a model the gateway does not know had inference read its repository
    again: ModelReady, which takes no key, with a random name each call made 2,780 reads in
    5.2 s from 4 callers (a security probe; the tenants' p95 21 -> 53 ms). Reads are
    REREAD_MIN_S apart, and requests waiting meanwhile share the next one; a version
    published a moment ago is still found by the request that asks for it."""
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]

    async def flood(until: float) -> int:
        asked = 0
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            with contextlib.suppress(RequestError):
                await catalogue.resolve(f"random-{asked}", "", 5.0)
            asked += 1
        return asked

    async def run() -> tuple[int, int]:
        await catalogue.refresh()
        loop = asyncio.get_running_loop()
        until = loop.time() + 4 * REREAD_MIN_S
        asked = sum(await asyncio.gather(*(flood(until) for _ in range(4))))
        inference.listed = TWO  # a version published now: found by its first request
        found = await catalogue.resolve("intents", "2", 5.0)
        assert found.version == "2"
        return asked, inference.calls

    asked, calls = asyncio.run(run())
    assert asked >= 8
    assert calls <= 1 + 4 + 2  # the first read, one a spacing, the published version's


def _refused(name: str, version: str) -> tuple[RequestError, int]:
    """What resolving `name` at `version` in a catalogue serving intents/1 refuses with, and
    how many times it read inference's model list."""
    inference = Inference()
    catalogue = ModelCatalogue(inference)  # type: ignore[arg-type]

    async def run() -> RequestError:
        await catalogue.refresh()
        with pytest.raises(RequestError) as refused:
            await catalogue.resolve(name, version, 5.0)
        return refused.value

    return asyncio.run(run()), inference.calls


@pytest.mark.parametrize("version", ["0", "-1", "abc", "01", " 1", "1.0", "+1", "1e3", "\u0661"])
def test_a_malformed_version_is_invalid_argument_without_a_reread(version: str) -> None:
    """Versions are folders named by a positive integer without leading zeros
    (model/repository.py:is_version). Found probing a running mesh: "-1", "abc", "01" or " 4"
    each waited half a second for a re-read of the list (and inference's rescan of its
    repository), then got NOT_FOUND, as if the version could have been published meanwhile."""
    err, calls = _refused("intents", version)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"model version {version!r} of 'intents' is not a version" in err.message
    assert "positive integers without leading zeros" in err.message
    assert err.message.endswith("(serving: intents/1)")
    assert calls == 1  # the refresh only: no re-read for it


def test_a_huge_version_is_a_well_formed_one_not_served() -> None:
    """Digits alone may be published later: NOT_FOUND after a re-read, as before."""
    err, calls = _refused("intents", "9" * 23)
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert calls == 2


def test_an_empty_model_name_is_invalid_argument() -> None:
    """KServe's ModelInfer with no model_name and a version read "unknown model '/4'"."""
    err, calls = _refused("", "1")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "the model name is empty: name one (serving: intents/1)"
    assert calls == 1
