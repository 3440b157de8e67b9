"""The model repository: `<root>/<name>/<version>/` holding config.json and the artefacts.

Versions are positive integers and immutable once written; the empty version means the
latest. Every service that needs a model's files (tokenizer, inference, postprocess, cache)
reads them from here, as Triton's model repository works.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from hopline.model.providers import ProviderSpec, parse_providers
from hopline.model.quantize import Precision
from hopline.runtime.batching import BatchingPolicy
from hopline.runtime.config import SettingError
from hopline.runtime.errors import clip
from hopline.runtime.tensors import DTYPE_NAMES

CONFIG_FILE = "config.json"
# The unit-length embedding every classify graph outputs and its head takes in place of tokens
# (the cache's query vector is one: cache/service.py, services/inference/batched_model.py).
SENTENCE_EMBEDDING = "sentence_embedding"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
LABELS_OUTPUT = "logits"  # a classify graph's per-class output: one column per label


class ModelNotFoundError(LookupError):
    """No such model or version in the repository."""


class InvalidModelError(ValueError):
    """A model version whose config or files are broken."""


class CopyUnderWay(InvalidModelError):
    """A version folder whose files are not all there, or not all of one build: as while it
    is copied (a file config.json names is missing, or is not the one it was written with)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # KServe v2 names: INT64, FP32, ...
    shape: tuple[int, ...]  # -1 for a dynamic dimension


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    mode: str = "exact"  # off | exact | semantic
    threshold: float = 0.90  # cosine similarity a semantic hit needs
    ttl_s: float = 3600.0
    max_entries: int = 100_000  # per (tenant, model); the oldest go first
    # An out-of-scope or low-confidence answer is a poor thing to replay for similar texts.
    store_out_of_scope: bool = False
    min_score: float = 0.0
    # Verified semantic hits (docs/cache.md): the wrong-hit rate to stay under and the
    # confidence of that promise; 0 keeps the static threshold.
    verify_target: float = 0.0
    verify_confidence: float = 0.9

    @classmethod
    def from_json(cls, raw: Any) -> CachePolicy:
        """The `cache` block of a model's config.json (every key optional), each value of its
        field's JSON type: ValueError naming the key otherwise. A string threshold or a
        fractional max_entries passed the range checks (or raised a bare TypeError in them),
        loaded, and then failed every model-list read of every service, for every model, or
        stopped the mesh's start (a helper's probe)."""
        if not isinstance(raw, dict):
            raise ValueError(f"cache must be a JSON object, got {_json_type(raw)}")
        # Each field's type from its annotation (a string under `from __future__`).
        types = {f.name: _JSON_TYPES[str(f.type)] for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(types))
        if unknown:
            raise ValueError(f"unknown cache keys {unknown} (known: {sorted(types)})")
        for key, value in raw.items():
            if not _is_json_type(value, types[key]):
                raise ValueError(
                    f"cache.{key} must be {_TYPE_NAMES[types[key]]}, got {json.dumps(value)[:60]}"
                )
        values: dict[str, Any] = {k: float(v) if types[k] is float else v for k, v in raw.items()}
        return cls(**values)


def _json_type(value: Any) -> str:
    return type(value).__name__ if value is not None else "null"


# A field's annotation -> the JSON values it takes: a number is an int or a float (never a
# bool: JSON's true is Python's 1), a whole number an int.
_JSON_TYPES: dict[str, type] = {"str": str, "float": float, "int": int, "bool": bool}
_TYPE_NAMES = {str: "a string", float: "a number", int: "a whole number", bool: "true or false"}


def _is_json_type(value: Any, want: type) -> bool:
    if want is bool or want is str:
        return isinstance(value, want)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if want is int else isinstance(value, int | float)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    version: str
    path: Path
    task: str
    backend: str
    providers: tuple[ProviderSpec, ...]  # asked for, best first; CPU last
    precision: Precision
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    max_sequence_length: int
    labels: tuple[str, ...]
    oos_threshold: float
    cache: CachePolicy
    batching: BatchingPolicy
    files: dict[str, str]
    build: dict[str, Any]
    # The encoder whose embeddings the "head" file takes in place of tokens ("": none).
    head_embedder: str = ""
    # SHA-256 (hex) of each file `files` names, as `hopline model build` wrote them
    # (`checksum_problem`): empty in versions built before them, which are not checked.
    checksums: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.version}"

    def file(self, role: str) -> Path:
        return self.path / self.files[role]


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"model name {name!r} must be 1-63 chars of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return name


def _specs(raw: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    specs = tuple(TensorSpec(str(s["name"]), s["dtype"], tuple(s["shape"])) for s in raw)
    for spec in specs:
        if spec.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"tensor {spec.name!r} has dtype {spec.dtype!r}: one of "
                f"{', '.join(sorted(DTYPE_NAMES))}"
            )
        if not all(isinstance(d, int) and (d == -1 or d > 0) for d in spec.shape):
            raise ValueError(f"tensor {spec.name!r} has shape {list(spec.shape)}: -1 or > 0 each")
    return specs


def _read_json(path: Path) -> Any:
    """A JSON file's document; ValueError naming the file and what is wrong with it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path.name} is not JSON: {exc}") from exc


def _require_object(value: Any, where: str) -> None:
    """Said by name: indexing a list or a string left "list indices must be integers or
    slices, not str" as the reason a version was not served (a helper's probe)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {_json_type(value)}")


def _labels(path: Path) -> tuple[str, ...]:
    labels = _read_json(path)
    if not (isinstance(labels, list) and labels and all(isinstance(x, str) and x for x in labels)):
        raise ValueError(f"{path.name} must be a JSON list of non-empty label strings")
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path.name} names a label twice: each column needs its own")
    return tuple(labels)


def labels_problem(cfg: ModelConfig) -> str | None:
    """A classify version whose labels do not match its graph's per-class output: every
    answer would fail (or be mislabelled), so the version is refused at load."""
    for spec in cfg.outputs:
        per_class = spec.name == LABELS_OUTPUT and len(spec.shape) == 2 and spec.shape[1] > 0
        if per_class and spec.shape[1] != len(cfg.labels):
            return (
                f"{cfg.files['labels']} has {len(cfg.labels)} labels, but output "
                f"{LABELS_OUTPUT!r} has {spec.shape[1]} columns: one label per column"
            )
    return None


MAX_ENTRIES_LIMIT = 2**63 - 1  # int64 in inference.proto's CachePolicy
INT32_MAX = 2**31 - 1  # ModelInfo.max_batch_size, and what a tensor's dimension can be


def _whole(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    """config.json's `key`, a whole number from `low` to `high`; ValueError naming it. A
    max_batch_size of 3e9 loaded and then failed every model-list read of every model (out of
    the proto's int32), and a max_sequence_length of 0 failed every request as the client's
    fault (a helper's probe)."""
    value = raw[key]
    if not _is_json_type(value, int) or not low <= value <= high:
        raise ValueError(
            f"{key} must be a whole number from {low} to {high}, got {json.dumps(value)[:60]}"
        )
    return int(value)


def _score(raw: dict[str, Any], key: str) -> float:
    """config.json's `key`, a number from 0 to 1 (a score): an oos_threshold of 5 sent every
    answer out of scope, unsaid (`hopline model build` refuses it; the services did not)."""
    value = raw[key]
    if not _is_json_type(value, float) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{key} must be a number from 0 to 1 (a score), got {json.dumps(value)[:60]}"
        )
    return float(value)


def cache_problem(cache: CachePolicy) -> str | None:
    """What makes a cache policy unusable, or None: the services refuse such a version, and
    `hopline model build` refuses to build one."""
    if cache.mode not in ("off", "exact", "semantic"):
        return "cache.mode must be off, exact or semantic"
    # A TTL of infinity (JSON's 1e999) or NaN would pass `> 0`; the cache refuses every store
    # of such an entry (cache/intake.py), so the version is refused here, where it is said.
    if not 0.0 < cache.threshold <= 1.0 or not 0 < cache.ttl_s < math.inf or cache.max_entries < 1:
        return "cache needs 0 < threshold <= 1, ttl_s > 0 and finite, and max_entries >= 1"
    if cache.max_entries > MAX_ENTRIES_LIMIT:
        return f"cache.max_entries must be at most {MAX_ENTRIES_LIMIT} (what the services send)"
    if not 0.0 <= cache.verify_target < 1.0 or not 0.0 < cache.verify_confidence < 1.0:
        return "cache needs 0 <= verify_target < 1 and 0 < verify_confidence < 1"
    # An answer's score is its label's probability: past 1 nothing would ever be stored, and
    # nothing said so.
    if not 0.0 <= cache.min_score <= 1.0:
        return "cache needs 0 <= min_score <= 1 (an answer's score is its label's probability)"
    return None


def load_config(path: Path, expect: tuple[str, str] | None = None) -> ModelConfig:
    """Read `<path>/config.json` and check that the files it names exist. The config must
    name the model and version of its folders, or `expect` (a build checks its staging
    folder before publishing it under that name)."""
    try:
        raw = _read_json(path / CONFIG_FILE)
        _require_object(raw, CONFIG_FILE)
        _require_object(raw.get("files", {}), f"{CONFIG_FILE}'s 'files'")
        labels = _labels(path / raw["files"]["labels"])
        cfg = ModelConfig(
            name=raw["name"],
            version=str(raw["version"]),
            path=path,
            task=raw["task"],
            backend=raw["backend"],
            providers=parse_providers(raw["providers"]),
            precision=Precision(raw["precision"]),
            inputs=_specs(raw["inputs"]),
            outputs=_specs(raw["outputs"]),
            max_batch_size=_whole(raw, "max_batch_size", 1, INT32_MAX),
            max_sequence_length=_whole(raw, "max_sequence_length", 1, INT32_MAX),
            labels=labels,
            oos_threshold=_score(raw, "oos_threshold"),
            cache=CachePolicy.from_json(raw.get("cache", {})),
            batching=BatchingPolicy.from_json(
                raw.get("dynamic_batching", {}), _whole(raw, "max_batch_size", 1, INT32_MAX)
            ),
            files=dict(raw["files"]),
            build=dict(raw.get("build", {})),
            head_embedder=str(raw.get("head_embedder", "")),
            checksums=_checksums(raw.get(CHECKSUMS, {})),
        )
    except KeyError as exc:
        raise InvalidModelError(f"{path}: {CONFIG_FILE} has no {exc}") from exc
    except (OSError, TypeError, ValueError) as exc:
        raise InvalidModelError(f"{path}: {exc}") from exc
    name, version = expect or (path.parent.name, path.name)
    if (cfg.name, cfg.version) != (name, version):
        raise InvalidModelError(
            f"{path}: config says {cfg.name}/{cfg.version}, the directory says {name}/{version}"
        )
    problem = cache_problem(cfg.cache) or labels_problem(cfg)
    if problem is not None:
        raise InvalidModelError(f"{path}: {problem}")
    if cfg.head_embedder and "head" not in cfg.files:
        raise InvalidModelError(f"{path}: head_embedder is set but files has no head")
    for role in cfg.files:
        if not cfg.file(role).is_file():
            raise CopyUnderWay(f"{path}: missing {role} file {cfg.files[role]}")
    if problem := checksum_problem(cfg):
        raise CopyUnderWay(f"{path}: {problem}")
    return cfg


CHECKSUMS = "checksums"  # config.json's key


def _checksums(raw: Any) -> dict[str, str]:
    if not (isinstance(raw, dict) and all(isinstance(v, str) for v in raw.values())):
        raise ValueError(f"{CHECKSUMS} must map file names to SHA-256 hex digests")
    return dict(raw)


def file_checksums(folder: Path, files: dict[str, str]) -> dict[str, str]:
    """The SHA-256 (hex) of each file `files` names, for config.json's `checksums`."""
    return {name: _file_digest(folder / name).hex() for name in sorted(set(files.values()))}


def checksum_problem(cfg: ModelConfig) -> str | None:
    """A file that is not the one config.json was written with: the folder holds files of
    two builds, as while a copy over it is under way (each service would load the files it
    found: a helper's probe saw labels.json arrive first, its label count unchanged, and
    every stage answer the new labels over the old model's scores for 40 s, cached). The
    version is then left out, or served from the files loaded before, until they agree."""
    for name, want in cfg.checksums.items():
        if name in cfg.files.values() and _file_digest(cfg.path / name).hex() != want:
            return (
                f"{name} is not the file {CONFIG_FILE} was written with (its SHA-256 differs): "
                "the folder holds files of two builds, as while a copy over it is under way"
            )
    return None


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    doc = dataclasses.asdict(cfg)
    doc.pop("path")
    doc.pop("labels")
    batching = doc.pop("batching")
    batching.pop("max_in_flight")
    doc["dynamic_batching"] = dict(batching, length_buckets=list(batching["length_buckets"]))
    for kind in ("inputs", "outputs"):
        doc[kind] = [dict(s, shape=list(s["shape"])) for s in doc[kind]]
    doc["providers"] = [p.to_json() for p in cfg.providers]
    doc["precision"] = cfg.precision.value
    return doc


def version_digest(folder: Path) -> str:
    """A fingerprint of a version's files, names and contents (16 hex digits of a SHA-256):
    the same on every replica that holds the same files, and different for a version number
    that was deleted and published again with other files, so the cache never serves one
    build's answers for another's (gateway/call.py puts it in every cache scope)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + _file_digest(path))
    return digest.hexdigest()[:16]


# Each file's SHA-256 by what its stat says (path, size, mtime, inode, ctime: what the model
# registry takes for "these files changed"): the tokenizer, inference and postprocess each
# fingerprint a new version, and co-located they share a process, so two of the three reads
# of a 90 MB model.onnx (about 60 ms each) are skipped.
# Least recently used out first: a file read on every check stays while others come and go.
_FILE_DIGESTS: OrderedDict[tuple[str, int, int, int, int], bytes] = OrderedDict()
_FILE_DIGESTS_KEPT = 256
_FILE_DIGESTS_LOCK = threading.Lock()  # the services' threads check versions side by side
_HASH_STEP = 16 << 20


def _file_digest(path: Path) -> bytes:
    """One file's SHA-256, read and hashed in 16 MiB steps: hashlib and the read let go of the
    GIL for each step, and in 256 KiB steps (hashlib.file_digest's) a busy event loop on
    another thread held up every step's return (a new model's first request took 2-3x as long
    to tokenize while the gateway served others). Read, not memory-mapped: a file truncated
    while mapped (copied over in place) kills the process with SIGBUS."""
    with path.open("rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        with _FILE_DIGESTS_LOCK:
            known = _FILE_DIGESTS.get(key)
            if known is not None:
                _FILE_DIGESTS.move_to_end(key)
                return known
        digest = hashlib.sha256()
        buffer = bytearray(min(st.st_size, _HASH_STEP) or 1)
        view = memoryview(buffer)
        while read := f.readinto(buffer):
            digest.update(view[:read])
    found = digest.digest()
    with _FILE_DIGESTS_LOCK:
        _FILE_DIGESTS[key] = found
        _FILE_DIGESTS.move_to_end(key)
        while len(_FILE_DIGESTS) > _FILE_DIGESTS_KEPT:
            _FILE_DIGESTS.popitem(last=False)
    return found


def is_version(folder: str) -> bool:
    """Version folders are named by a positive integer in ASCII digits, as it is written
    (`1`, not `0`, `v1` or `01`: `01` and `1` were served side by side as two versions, and
    tied for the latest). Read as text, not converted: int() refuses a string past 4,300
    digits, and the gateway asks this of any version a caller sends."""
    return folder.isascii() and folder.isdigit() and not folder.startswith("0")


def _present(folder: Path) -> bool:
    try:
        return (folder / CONFIG_FILE).is_file()
    except PermissionError:
        return True  # there, but unreadable: loading it says so


class ModelRepository:
    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def setting(cls, raw: str) -> ModelRepository:
        """The repository HOPLINE_MODEL_REPO names; SettingError (exit 2) when it is empty,
        which Path() reads as the working folder: a service served from wherever it was
        started (a settings probe)."""
        if not raw.strip():
            raise SettingError("HOPLINE_MODEL_REPO is empty: give the model repository's folder")
        return cls(Path(raw))

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and self._holds(p.name))

    def _holds(self, name: str) -> bool:
        """Whether a model folder holds a version, or cannot be listed (its scan says why)."""
        try:
            return bool(self.versions(name) or self.misnamed(name))
        except OSError:
            # Said only for a folder that could be a model: a volume's root-only lost+found
            # would be warned about at every start of every service.
            return _NAME_RE.match(name) is not None

    def versions(self, name: str) -> list[str]:
        """The model's complete versions (folders named by a positive integer that hold a
        config.json, or whose config.json cannot be looked at: loading it says why).
        OSError when the model's folder cannot be listed."""
        base = self.root / name
        if not base.is_dir():
            return []
        found = [p.name for p in base.iterdir() if is_version(p.name) and _present(p)]
        return sorted(found, key=int)

    def misnamed(self, name: str) -> list[str]:
        """Folders of the model that hold a config.json but are not named as versions are
        (`v7`, `0`): never served, so worth saying."""
        base = self.root / name
        if not base.is_dir():
            return []
        # A hidden folder is `model build`'s staging (its config.json written just before
        # the rename), or anything else a user hid: neither is a misnamed version.
        return sorted(
            p.name
            for p in base.iterdir()
            if p.is_dir() and not p.name.startswith(".") and not is_version(p.name) and _present(p)
        )

    def next_version(self, name: str) -> str:
        taken = [int(v) for v in self.versions(name)]
        # Also skip half-written or foreign directories: versions are never reused.
        base = self.root / name
        if base.is_dir():
            taken += [int(p.name) for p in base.iterdir() if is_version(p.name)]
        return str(max(taken, default=0) + 1)

    def resolve(self, name: str, version: str = "") -> ModelConfig:
        try:
            versions = self.versions(name)
        except OSError as exc:
            # A name no folder can have (past the file system's 255 bytes: an internal
            # service answered UNKNOWN with the repository's path, a fuzzing probe). Any
            # other error is the repository's, not the name's.
            if exc.errno != errno.ENAMETOOLONG:
                raise
            versions = []
        if not versions:
            known = ", ".join(self.names()) or "none"
            raise ModelNotFoundError(f"unknown model {clip(name)!r} (repository has: {known})")
        if not version:
            version = versions[-1]
        if version not in versions:
            raise ModelNotFoundError(
                f"model {name!r} has no version {clip(version)!r} (has: {', '.join(versions)})"
            )
        return load_config(self.root / name / version)

    def all(self) -> list[ModelConfig]:
        return [load_config(self.root / n / v) for n in self.names() for v in self.versions(n)]
