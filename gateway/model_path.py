"""The model's side of a request's path in the gateway: tokenize, infer, postprocess.

GatewayService.predict_text calls `tokenize_early` (the Tokenize hop as a task, to overlap
the cache lookup), `speculate` (the whole inference beside the lookup, where the model's
recent lookups mostly miss: gateway/speculation.py) and, on a miss, `infer_once`: one
inference shared by identical plain misses in flight (the Coalescer), each stage through
`call_hop` (spans, timings, deadline), as one RPC per request or a stage batch
(gateway/stage_batching.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link

from hopline.gateway.cache_path import CachePath
from hopline.gateway.call import PredictCall
from hopline.gateway.direct_hop import StageHop
from hopline.gateway.resilience import CircuitState, Coalescer
from hopline.gateway.speculation import Speculation
from hopline.gateway.stage_batching import GatewayStages
from hopline.gateway.upstream import GatewayUpstreams, HopError
from hopline.observability import metrics, schema
from hopline.observability.logs import Episodes
from hopline.observability.tracing import child_span
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2

log = logging.getLogger("hopline.gateway.model_path")
FILES_DIFFER = Episodes(
    log, "a stage answered from other model files than the model list's; answer not cached"
)
STAGES_DIFFER = Episodes(
    log, "the stages answered from different files of one model version; asked again"
)
# The stages, by the names check_files and the replies' digests go under.
TOKENIZE, INFERENCE, POSTPROCESS = "tokenize", "inference", "postprocess"


def check_files(call: PredictCall, stage: str, digest: str) -> None:
    """Notes a stage whose answer came from files other than those the scope's digest names
    (a version changed in place: each service reloads it on its own, and until all have, an
    answer may mix old and new files; cached, it would be replayed for its TTL). An empty
    digest is a service from before the field: nothing to compare."""
    if digest and digest != call.info.digest:
        call.files_differ[stage] = digest


class ModelPath:
    """The model's steps of predict_text, over the gateway's upstreams (or their stage
    batches) and the coalescer the service holds."""

    def __init__(
        self,
        upstreams: GatewayUpstreams,
        stages: GatewayStages | None,
        coalescer: Coalescer[common_pb2.Prediction],
        speculation: Speculation,
        cache_path: CachePath,
    ) -> None:
        self.upstreams = upstreams
        tokenize, infer, post = (
            (stages.tokenize, stages.infer, stages.postprocess) if stages else (None, None, None)
        )
        self.tokenize = StageHop[tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse](
            schema.SPAN_TOKENIZE, upstreams.tokenizer, tokenize, "Tokenize"
        )
        self.infer = StageHop[inference_pb2.InferRequest, inference_pb2.InferResponse](
            schema.SPAN_INFERENCE, upstreams.inference, infer, "Infer"
        )
        self.postprocess = StageHop[
            postprocess_pb2.PostprocessRequest, postprocess_pb2.PostprocessResponse
        ](schema.SPAN_POSTPROCESS, upstreams.postprocess, post, "Postprocess")
        self.coalescer = coalescer
        self.speculation = speculation
        self.cache_path = cache_path

    def tokenize_early(self, call: PredictCall) -> None:
        """Ask for the text's token ids now, in a task of their own, so the cache lookup
        overlaps them (a request with no lookup to wait for tokenizes in its own task)."""
        call.tokenizing = asyncio.ensure_future(self._tokenize_hop(call))

    async def _tokens(self, call: PredictCall) -> tokenizer_pb2.TokenizeResponse:
        """The text's token ids: the early request's, else asked for now. The early request
        belongs to `call`'s request, which drops it once it needs it no more (a cache hit, or
        its caller gone); a run shared with other requests (the coalescer's) then asks again
        rather than end for all of them (a reviewer: a joined request was cancelled, its own
        caller still waiting)."""
        early = call.tokenizing
        if early is not None:
            try:
                return await asyncio.shield(early)
            except asyncio.CancelledError:
                this = asyncio.current_task()
                if not early.cancelled() or (this is not None and this.cancelling()):
                    raise  # this run itself was cancelled
        return await self._tokenize_hop(call)

    def _tokenize_hop(
        self, call: PredictCall, expect: str | None = None
    ) -> Awaitable[tokenizer_pb2.TokenizeResponse]:
        return self.tokenize(
            tokenizer_pb2.TokenizeRequest(
                model=call.info.name,
                model_version=call.info.version,
                texts=[call.text],
                model_digest=call.info.digest if expect is None else expect,
            ),
            call.left_s(),
            call.timings,
        )

    def speculate(
        self, call: PredictCall
    ) -> asyncio.Future[tuple[common_pb2.Prediction, bool]] | None:
        """The inference started now, beside the lookup, when the policy says it pays."""
        # Only beside a lookup that will be made (allow() would take a half-open probe).
        if not (call.use_cache and self.cache_path.breaker.state == CircuitState.CLOSED):
            return None
        if self.cache_path.expects_embedding(call):
            return None
        if not self.speculation.should(call.info.name):
            return None
        call.speculative = True
        return asyncio.ensure_future(self.infer_once(call))

    async def infer_once(self, call: PredictCall) -> tuple[common_pb2.Prediction, bool]:
        """An inference for this text, shared with identical plain misses running now, and
        whether it ran for this request (the one that ran it stores the answer)."""
        if call.mode != common_pb2.CACHE_MODE_USE:
            # REFRESH and BYPASS ask for an inference of their own.
            return await self.tokenize_infer_postprocess(call), True
        waited = time.perf_counter()
        while True:
            joined = self.coalescer.running(call.key)
            try:
                with self._joining(call.key) if joined else contextlib.nullcontext():
                    prediction, shared = await self.coalescer.run(
                        call.key, lambda: self.tokenize_infer_postprocess(call)
                    )
                break
            except HopError as err:
                # A joined run has its leader's deadline, not this request's: when that ends
                # it, this request runs again (leading a run, or joining a newer one).
                left_s = call.left_s()
                if not (joined and err.code == grpc.StatusCode.DEADLINE_EXCEEDED and left_s > 0):
                    raise
                metrics.COALESCED_RERUN.inc()
        if shared:
            call.drop_tokens()
            metrics.COALESCED.inc()
            call.cache.coalesced = True
            call.timings["coalesced_wait"] = (time.perf_counter() - waited) * 1e3
        if call.speculative:
            metrics.SPECULATIVE.labels("used").inc()
        return prediction, not shared

    def _joining(self, key: str) -> contextlib.AbstractContextManager[trace.Span]:
        """A span for the wait, linked to the run's: without it the wait read as the
        gateway's own time in the joiner's trace, its hops in another trace unnamed."""
        leader = self.coalescer.leader(key)
        links = [Link(leader)] if leader else []
        return child_span(schema.SPAN_COALESCED_WAIT, links=links, quiet=True)

    async def tokenize_infer_postprocess(self, call: PredictCall) -> common_pb2.Prediction:
        """The three stages for one text, from one build of the version: a version changed in
        place is reloaded by each service on its own, so the stages may answer from different
        files (new labels over the old model's logits: a wrong label). Then each is asked
        again expecting another's files, which makes the lagging ones look at the repository
        now; stages that still differ fail the request UNAVAILABLE rather than answer it."""
        metrics.INFERENCES.inc()
        info = call.info
        prediction, answered = await self._stages(call, {})
        if _mixed(answered):
            STAGES_DIFFER.failed(
                (info.name, info.version),
                "differ",
                model=info.name,
                version=info.version,
                stages=answered,
            )
            metrics.STAGES_ASKED_AGAIN.inc()
            prediction, answered = await self._stages(call, _other_files(answered))
            if _mixed(answered):
                raise HopError(
                    INFERENCE,
                    grpc.StatusCode.UNAVAILABLE,
                    f"model {info.name} version {info.version} is being changed in place: its "
                    f"stages answered from different files ({_said(answered)}); retry once "
                    "every service has the new files (a version that does not load everywhere "
                    "stays so until its files are fixed)",
                )
        STAGES_DIFFER.ended((info.name, info.version))
        for stage, digest in answered.items():
            check_files(call, stage, digest)
        if call.files_differ:  # not stored (counted where the store is decided)
            FILES_DIFFER.failed(
                (info.name, info.version),
                "differ",
                model=info.name,
                version=info.version,
                listed_digest=info.digest,
                stages=call.files_differ,
            )
        else:
            FILES_DIFFER.ended((info.name, info.version))
        return prediction

    async def _stages(
        self, call: PredictCall, expect: dict[str, str]
    ) -> tuple[common_pb2.Prediction, dict[str, str]]:
        """One pass of the stages, each told to expect the files `expect` names for it (the
        model list's by default); returns the answer and each stage's files (empty digests,
        from services older than the field, left out)."""
        info = call.info
        answered: dict[str, str] = {}
        if call.embedding is not None:
            inputs = [call.embedding]  # the head alone (_take_embedding)
        else:
            # Asked again: tokenized again, the early request's ids may be the other build's.
            tokens = await (
                self._tokenize_hop(call, expect.get(TOKENIZE, info.digest))
                if expect
                else self._tokens(call)
            )
            answered[TOKENIZE] = tokens.model_digest
            inputs = [tokens.input_ids, tokens.attention_mask]
        inferred = await self.infer(
            inference_pb2.InferRequest(
                model=info.name,
                model_version=info.version,
                inputs=inputs,
                outputs=["logits"],
                model_digest=expect.get(INFERENCE, info.digest),
            ),
            call.left_s(),
            call.timings,
        )
        answered[INFERENCE] = inferred.model_digest
        call.timings["inference.queue"] = inferred.queue_ms
        call.timings["inference.compute"] = inferred.compute_ms
        post = await self.postprocess(
            postprocess_pb2.PostprocessRequest(
                model=info.name,
                model_version=info.version,
                outputs=inferred.outputs,
                top_k=call.top_k,
                model_digest=expect.get(POSTPROCESS, info.digest),
            ),
            call.left_s(),
            call.timings,
        )
        answered[POSTPROCESS] = post.model_digest
        return post.predictions[0], {stage: d for stage, d in answered.items() if d}


def _mixed(answered: dict[str, str]) -> bool:
    return len(set(answered.values())) > 1


def _other_files(answered: dict[str, str]) -> dict[str, str]:
    """For each stage, a build another stage answered from. A stage without those files
    looks at the repository at once and loads them if they are there, and one that kept them
    from before a reload answers from them, so the second pass settles on a build every
    stage has, where there is one."""
    return {
        stage: next(d for d in answered.values() if d != digest)
        for stage, digest in answered.items()
    }


def _said(answered: dict[str, str]) -> str:
    return ", ".join(f"{stage} {digest}" for stage, digest in answered.items())
