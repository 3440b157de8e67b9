"""hopline.postprocess.v1.PostprocessService on grpc.aio."""

from __future__ import annotations

import dataclasses
from typing import cast

import grpc
import numpy as np
import numpy.typing as npt

from hopline.model.head import F32
from hopline.model.registry import LINGER_REFRESHES, ModelRegistry
from hopline.model.repository import (
    SENTENCE_EMBEDDING,
    ModelConfig,
    ModelNotFoundError,
    ModelRepository,
    version_digest,
)
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.runtime.config import (
    ServerConfig,
    env_field,
    listen_field,
    metrics_port_field,
    model_refresh_field,
)
from hopline.runtime.errors import status_text
from hopline.runtime.tensors import TensorError, by_name, from_tensor
from hopline.services.postprocess.logic import predictions


@dataclasses.dataclass(frozen=True)
class PostprocessConfig(ServerConfig):
    listen: str = listen_field("postprocess")
    metrics_port: int = metrics_port_field("postprocess")
    model_repo: str = env_field("HOPLINE_MODEL_REPO", "models", "model repository directory")
    model_refresh_s: float = model_refresh_field(
        "how often requests rescan the model repository (removed or replaced versions)"
    )


class PostprocessService(postprocess_pb2_grpc.PostprocessServiceServicer):
    service_names = (postprocess_pb2.DESCRIPTOR.services_by_name["PostprocessService"].full_name,)

    def __init__(self, config: PostprocessConfig) -> None:
        self.config = config
        # Postprocessing needs only the config (labels, threshold), not the weights; what it
        # keeps per version is the digest of the files it read them from.
        # Rescanned every few seconds from requests: a removed or replaced version is let go.
        self.models: ModelRegistry[str] = ModelRegistry(
            ModelRepository.setting(config.model_repo),
            lambda cfg: version_digest(cfg.path),
            rescan_s=config.model_refresh_s,
            linger_s=LINGER_REFRESHES * config.model_refresh_s,
            digest_of=lambda digest: digest,
            # Answer the gateway's model list's build until it names the new one.
            keep_replaced=True,
        )

    def register(self, server: grpc.aio.Server) -> None:
        postprocess_pb2_grpc.add_PostprocessServiceServicer_to_server(self, server)

    async def start(self) -> None:
        if not self.models.load_all():
            self.models.check_start()

    async def stop(self) -> None:
        return None

    async def Postprocess(
        self,
        request: postprocess_pb2.PostprocessRequest,
        context: grpc.aio.ServicerContext[
            postprocess_pb2.PostprocessRequest, postprocess_pb2.PostprocessResponse
        ],
    ) -> postprocess_pb2.PostprocessResponse:
        try:
            cfg, digest = await self.models.find(
                request.model, request.model_version, request.model_digest
            )
        except ModelNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, status_text(str(exc)))
        top_k = request.top_k or 1
        if not 1 <= top_k <= len(cfg.labels):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"top_k must be 1 to {len(cfg.labels)} for {cfg.key}, got {request.top_k}",
            )
        try:
            named = by_name(request.outputs, "output")
            tensors = {name: from_tensor(t) for name, t in named.items()}
            logits = tensors.get("logits")
            embeddings = tensors.get(SENTENCE_EMBEDDING) if request.include_embedding else None
            if logits is None and embeddings is None:
                raise TensorError("needs a 'logits' or 'sentence_embedding' output")
            for name, array in (("logits", logits), (SENTENCE_EMBEDDING, embeddings)):
                if array is not None and (array.ndim != 2 or array.dtype != np.float32):
                    raise TensorError(
                        f"{name} must be FP32 [batch, n], got {array.dtype} {list(array.shape)}"
                    )
            if logits is not None and logits.shape[1] != len(cfg.labels):
                raise TensorError(
                    f"logits have {logits.shape[1]} classes, {cfg.key} has {len(cfg.labels)} labels"
                )
            _check_rows_and_width(cfg, logits, embeddings)
            if logits is not None and embeddings is not None and len(logits) != len(embeddings):
                raise TensorError("logits and sentence_embedding differ in batch size")
        except TensorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_text(str(exc)))
        if logits is not None and not np.isfinite(logits).all():
            # A softmax of them is NaN: answered OK with score nan and a label of no meaning
            # (a fuzzing probe). The model's fault (an fp16 overflow, say), not the caller's.
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"{cfg.key}'s logits hold NaN or infinity: its output cannot be classified",
            )
        return postprocess_pb2.PostprocessResponse(
            predictions=predictions(
                cast("F32 | None", logits),
                cast("F32 | None", embeddings),
                cfg.labels,
                cfg.oos_threshold,
                top_k,
            ),
            model_digest=digest,
        )


def _check_rows_and_width(
    cfg: ModelConfig,
    logits: npt.NDArray[np.generic] | None,
    embeddings: npt.NDArray[np.generic] | None,
) -> None:
    """At most a model batch of rows, and embeddings as wide as the model's: each row becomes
    a prediction, so a `[3000000, 0]` tensor (no bytes at all) would hold the event loop for
    seconds and its memory with it."""
    for name, array in (("logits", logits), (SENTENCE_EMBEDDING, embeddings)):
        if array is not None and not 1 <= len(array) <= cfg.max_batch_size:
            raise TensorError(
                f"{name} has {len(array)} rows; {cfg.key} takes 1 to {cfg.max_batch_size}"
            )
    if embeddings is None:
        return
    # The model's declared width where it declares one (-1: any width but none).
    width = next((o.shape[-1] for o in cfg.outputs if o.name == SENTENCE_EMBEDDING), -1)
    if embeddings.shape[1] == 0 or (width > 0 and embeddings.shape[1] != width):
        wanted = width if width > 0 else "at least 1"
        raise TensorError(
            f"{SENTENCE_EMBEDDING} must be {wanted} wide for {cfg.key}, got {embeddings.shape[1]}"
        )
