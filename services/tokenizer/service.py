"""hopline.tokenizer.v1.TokenizerService on grpc.aio."""

from __future__ import annotations

import dataclasses

import grpc
from opentelemetry import trace
from tokenizers import Tokenizer

from hopline.model.registry import LINGER_REFRESHES, ModelRegistry
from hopline.model.repository import (
    ModelConfig,
    ModelNotFoundError,
    ModelRepository,
    version_digest,
)
from hopline.model.tokenizer import encode, load_tokenizer
from hopline.observability import schema
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from hopline.runtime.config import (
    AT_LEAST_ONE,
    ServerConfig,
    env_field,
    listen_field,
    metrics_port_field,
    model_refresh_field,
)
from hopline.runtime.errors import status_text
from hopline.runtime.tensors import to_tensor


@dataclasses.dataclass(frozen=True)
class TokenizerConfig(ServerConfig):
    listen: str = listen_field("tokenizer")
    metrics_port: int = metrics_port_field("tokenizer")
    model_repo: str = env_field("HOPLINE_MODEL_REPO", "models", "model repository directory")
    max_batch: int = env_field(
        "HOPLINE_TOKENIZER_MAX_BATCH", 256, "most texts in one request", valid=AT_LEAST_ONE
    )
    max_text_bytes: int = env_field(
        "HOPLINE_MAX_TEXT_BYTES", 16384, "longest text accepted, in UTF-8 bytes", valid=AT_LEAST_ONE
    )
    model_refresh_s: float = model_refresh_field(
        "how often requests rescan the model repository (removed or replaced versions)"
    )


def _load(cfg: ModelConfig) -> tuple[Tokenizer, str]:
    """The version's tokenizer and the digest of the files it was read with (computed
    first: files that change after it are a new signature, read again at the next rescan)."""
    digest = version_digest(cfg.path)
    return load_tokenizer(cfg.file("tokenizer"), cfg.max_sequence_length), digest


class TokenizerService(tokenizer_pb2_grpc.TokenizerServiceServicer):
    service_names = (tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name,)

    def __init__(self, config: TokenizerConfig) -> None:
        self.config = config
        # Rescanned every few seconds from requests: a removed or replaced version is let go.
        self.models = ModelRegistry(
            ModelRepository.setting(config.model_repo),
            _load,
            rescan_s=config.model_refresh_s,
            linger_s=LINGER_REFRESHES * config.model_refresh_s,
            digest_of=lambda loaded: loaded[1],
            # Answer the gateway's model list's build until it names the new one.
            keep_replaced=True,
        )

    def register(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(self, server)

    async def start(self) -> None:
        if not self.models.load_all():
            self.models.check_start()

    async def stop(self) -> None:
        return None

    async def Tokenize(
        self,
        request: tokenizer_pb2.TokenizeRequest,
        context: grpc.aio.ServicerContext[
            tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse
        ],
    ) -> tokenizer_pb2.TokenizeResponse:
        texts = list(request.texts)
        if not texts:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "texts is empty")
        if len(texts) > self.config.max_batch:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(texts)} texts in one request; the limit is {self.config.max_batch}, the "
                "tokenizer's HOPLINE_TOKENIZER_MAX_BATCH: send fewer at a time",
            )
        for i, text in enumerate(texts):
            if len(text.encode("utf-8")) > self.config.max_text_bytes:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"text {i} of the request is over {self.config.max_text_bytes} bytes, the "
                    "tokenizer's HOPLINE_MAX_TEXT_BYTES (set it as high as the gateway's)",
                )
        try:
            _, (tokenizer, digest) = await self.models.find(
                request.model, request.model_version, request.model_digest
            )
        except ModelNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, status_text(str(exc)))
        batch = encode(tokenizer, texts)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({schema.TOKENS: sum(batch.lengths), schema.BATCH_SIZE: len(texts)})
        return tokenizer_pb2.TokenizeResponse(
            input_ids=to_tensor("input_ids", batch.input_ids),
            attention_mask=to_tensor("attention_mask", batch.attention_mask),
            lengths=batch.lengths,
            truncated=batch.truncated,
            model_digest=digest,
        )
