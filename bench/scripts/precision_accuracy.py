"""CLINC150 in-scope accuracy of an INT8 build against the FP32 build it was converted from.

Builds clinc150 on the train split into a scratch repository (FP32, version 1, with
test_clinc150.py's flags), converts the same graph and head to INT8 as version 2 (what
`--precision int8` ships, without rebuilding the embeddings and head a second time: on a
shared 2-core machine that is most of an hour), then labels the 4500 in-scope test queries
with each version in this process (services/pipeline.py: the services' own code, no hops).
Out-of-scope answers count as wrong, as in tests/mesh/test_clinc150.py. Prints one JSON
object: accuracies, their difference in points, and how many labels changed.

Usage: .venv/bin/python bench/scripts/precision_accuracy.py [--clinc PATH] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import onnx
from onnx import numpy_helper

from hopline.model.build import build_model, default_weights_dir, load_examples
from hopline.model.encoder import ClassifierHead, build_encoder_graph
from hopline.model.outliers import calibration_feeds
from hopline.model.quantize import Precision, convert
from hopline.model.repository import CHECKSUMS, file_checksums
from hopline.model.tokenizer import DEFAULT_MAX_LENGTH, load_tokenizer
from hopline.observability.logs import LogFormat, setup_logging
from hopline.services.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]
CLINC = ROOT.parent / "shared" / "data" / "clinc150" / "data_full.json"


def convert_version(fp32: Path, target: Path, precision: Precision, train: Path) -> None:
    """`fp32`'s head on a fresh encoder graph, converted (calibrated on `train`'s train split):
    version 2 beside it."""
    model = onnx.load(str(fp32 / "model.onnx"))
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (gemm,) = [n for n in model.graph.node if n.op_type == "Gemm"]
    head = ClassifierHead(weights[gemm.input[1]], weights[gemm.input[2]])
    staging = target.parent / f".staging-{target.name}"
    shutil.copytree(fp32, staging)
    weights_dir = default_weights_dir()
    tokenizer = load_tokenizer(weights_dir / "tokenizer.json", DEFAULT_MAX_LENGTH)
    calibration = calibration_feeds(tokenizer, [t for t, _ in load_examples(train, "train")])
    graph = build_encoder_graph(weights_dir, head)
    convert(graph, precision, staging / "model.onnx", calibration)
    config = json.loads((staging / "config.json").read_text())
    config.update(version=target.name, precision=precision.value)
    config[CHECKSUMS] = file_checksums(staging, config["files"])  # its own model file's
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clinc", type=Path, default=CLINC)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    setup_logging("precision-accuracy", fmt=LogFormat.TEXT)
    repo = (args.work or Path(tempfile.mkdtemp(prefix="hopline-precision-"))) / "models"
    test = json.loads(args.clinc.read_text(encoding="utf-8"))["test"]
    texts, gold = [t for t, _ in test], [g for _, g in test]
    result: dict[str, object] = {"repo": str(repo), "queries": len(texts)}
    labels: dict[str, list[str]] = {}
    for version, precision in (("1", Precision.FP32), ("2", Precision.INT8)):
        started = time.perf_counter()
        if precision is Precision.FP32 and not (repo / "clinc150" / version).is_dir():
            build_model(
                args.clinc, "clinc150", repo, version="1", split="train", in_scope_reject_rate=0.01
            )
        elif precision is Precision.INT8 and not (repo / "clinc150" / version).is_dir():
            convert_version(repo / "clinc150" / "1", repo / "clinc150" / "2", precision, args.clinc)
        built = time.perf_counter() - started
        pipeline = Pipeline.load(repo, "clinc150", version)
        labels[precision] = [p.label for p in pipeline.predict_many(texts)]
        accuracy = sum(p == g for p, g in zip(labels[precision], gold, strict=True)) / len(gold)
        result[precision.value] = {"accuracy": round(accuracy, 4), "build_s": round(built, 1)}
    fp32, int8 = labels[Precision.FP32], labels[Precision.INT8]
    acc = {p: result[p]["accuracy"] for p in ("fp32", "int8")}  # type: ignore[index]
    result["accuracy_drop_points"] = round(100 * (acc["fp32"] - acc["int8"]), 2)
    result["labels_changed"] = sum(a != b for a, b in zip(fp32, int8, strict=True))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
