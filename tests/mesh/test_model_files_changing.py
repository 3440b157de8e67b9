"""A version's files changed in place while the mesh serves: each service reloads them on
its own, so for a while one stage has the old files and another the new. Every answer must
still come from one build (new labels over the old model's logits are a wrong label), the
one the gateway's model list names while the stages have it, and be cached only under that
build's digest.

The stages lag here for as long as the test needs: a service re-reads the repository only
hourly where the test says so (`HOPLINE_MODEL_REFRESH_S`); in production the window is a
refresh period (10 s), or as long as new files do not load everywhere.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from model_files import reseal
from prometheus_client.parser import text_string_to_metric_families as parse_text

from conftest import DEFAULT_MODEL
from harness import Mesh, eventually
from hopline.gateway.client import predict
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2

MISS = common_pb2.CACHE_OUTCOME_MISS
EXACT = common_pb2.CACHE_OUTCOME_EXACT
RELOADED = "model version changed; loaded from its new files"


@pytest.fixture
def mesh(default_repo: Path, tmp_path: Path) -> Iterator[Mesh]:
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    m = Mesh(
        repo,
        tmp_path,
        service_env={
            "postprocess": {"HOPLINE_MODEL_REFRESH_S": "3600"},
            "gateway": {"HOPLINE_MODEL_REFRESH_S": "0.5"},
        },
    )
    try:
        yield m.start()
    finally:
        m.stop()


def ask(mesh: Mesh, text: str, cache: str = "use") -> gateway_pb2.PredictResponse:
    return predict(text, gateway=mesh.gateway, cache_mode=cache, timeout_s=60)


def stores(mesh: Mesh, result: str) -> float:
    url = f"http://127.0.0.1:{mesh.metrics_ports['gateway']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        families = parse_text(reply.read().decode())
    return sum(
        s.value
        for family in families
        for s in family.samples
        if s.name == "hopline_cache_stores_total" and s.labels.get("result") == result
    )


def swap_labels(folder: Path, first: str, second: str) -> None:
    """A new build's labels.json over the old one, in place, as a sync of the folder does."""
    labels_file = folder / "labels.json"
    labels: list[str] = json.loads(labels_file.read_text())
    i, j = labels.index(first), labels.index(second)
    labels[i], labels[j] = labels[j], labels[i]
    staged = labels_file.with_name("labels.staged")
    staged.write_text(json.dumps(labels))
    staged.replace(labels_file)
    reseal(folder)


def test_a_stage_that_lags_behind_the_model_list_answers_from_the_new_files(mesh: Mesh) -> None:
    """Postprocess re-reads hourly; the gateway's list and inference have the new build.
    The request tells each stage which build the list names, so postprocess looks at the
    repository there and then: the answer is the new build's, and cached. Before, it was
    labelled with the old labels over the new model's logits (here: the old label), and
    counted skipped_files_differ."""
    before = ask(mesh, "I forgot my password", cache="bypass")
    assert before.prediction.label == "password_reset"
    swap_labels(mesh.repo / DEFAULT_MODEL / "1", "password_reset", "order_status")
    eventually(
        lambda: (
            ask(mesh, "I forgot my password", cache="bypass").model_digest != before.model_digest
        ),
        "the gateway's model list and inference have the new files",
    )

    text = "I forgot my password and the reset link never came"
    first = ask(mesh, text)
    assert first.cache.outcome == MISS
    assert first.prediction.label == "order_status", "postprocess answered from the old build"
    mesh.settle()
    again = ask(mesh, text)

    assert again.cache.outcome == EXACT
    assert again.prediction.label == "order_status"
    assert stores(mesh, "skipped_files_differ") == 0


@pytest.fixture
def lagging_list(default_repo: Path, tmp_path: Path) -> Iterator[Mesh]:
    """The gateway's model list re-read hourly (inference, which it is read from, loads a
    version's new files only when asked), the tokenizer and postprocess every 0.3 s."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    quick = {"HOPLINE_MODEL_REFRESH_S": "0.3"}
    m = Mesh(
        repo,
        tmp_path,
        service_env={
            "gateway": {"HOPLINE_MODEL_REFRESH_S": "3600"},
            "tokenizer": quick,
            "postprocess": quick,
        },
    )
    try:
        yield m.start()
    finally:
        m.stop()


def test_while_the_model_list_names_the_old_build_every_stage_answers_from_it(
    lagging_list: Mesh, default_repo: Path
) -> None:
    """The tokenizer and postprocess reload new files before inference and the gateway's
    list do: they keep the files they replaced and answer from them while the list names
    them. Files that never load everywhere (a model.onnx inference cannot read) leave no
    build every stage has: the request fails UNAVAILABLE saying so, never a mixed answer;
    once the files are fixed, answers come back from the new build."""
    mesh = lagging_list
    folder = mesh.repo / DEFAULT_MODEL / "1"
    swap_labels(folder, "password_reset", "order_status")
    eventually(lambda: reloads(mesh) == 1, "the tokenizer and postprocess reload the new files")

    text = "I forgot my password and the reset link never came"
    first = ask(mesh, text)
    assert first.cache.outcome == MISS
    # Before, postprocess labelled the old model's logits with the new labels: order_status.
    assert first.prediction.label == "password_reset", "an answer mixed two builds"
    mesh.settle()
    assert ask(mesh, text).cache.outcome == EXACT  # one build's answer, cached under its digest

    (folder / "model.onnx").write_bytes(b"not an onnx model")  # the next build, broken
    reseal(folder)
    eventually(lambda: reloads(mesh) == 2, "the tokenizer and postprocess reload again")
    with pytest.raises(grpc.RpcError) as failed:
        ask(mesh, "my parcel never arrived", cache="bypass")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "answered from different files" in (failed.value.details() or "")

    shutil.copyfile(default_repo / DEFAULT_MODEL / "1" / "model.onnx", folder / "model.onnx")
    reseal(folder)
    eventually(
        lambda: _label_or_none(mesh, "I forgot my password") == "order_status",
        "answers from the new build once its files load everywhere",
    )


def reloads(mesh: Mesh) -> int:
    """How often both the tokenizer and postprocess have reloaded the version from new files
    (after a request: they rescan from requests)."""
    _label_or_none(mesh, "I forgot my password")
    logs = [(mesh.workdir / f"{name}.log").read_text() for name in ("tokenizer", "postprocess")]
    return min(log.count(RELOADED) for log in logs)


def _label_or_none(mesh: Mesh, text: str) -> str | None:
    try:
        return ask(mesh, text, cache="bypass").prediction.label
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return None


def test_a_model_file_inference_cannot_load_leaves_the_old_build_serving_however_idle(
    lagging_list: Mesh, default_repo: Path
) -> None:
    """model.onnx broken in place (a copy over it cut short): the tokenizer and postprocess,
    whose own files did not change, load the new folder; inference cannot, and it and the
    model list stay on the old build. The stages kept the old build only while requests
    named it, `linger_s` (0.6 s here, 20 s by default): after a pause without a miss every
    miss failed UNAVAILABLE "its stages answered from different files" until the file was
    fixed (a helper's probe, both topologies). Now they keep it until the version changes
    again or leaves."""
    mesh = lagging_list
    folder = mesh.repo / DEFAULT_MODEL / "1"
    (folder / "model.onnx").write_bytes(b"not an onnx model")
    reseal(folder)  # a build whose model inference cannot read, not a copy under way
    eventually(lambda: reloads(mesh) == 1, "the tokenizer and postprocess reload the folder")
    time.sleep(3.0)  # no request: five times the stages' linger, and rescans meanwhile
    after = ask(mesh, "I forgot my password and the reset link never came", cache="bypass")
    assert after.prediction.label == "password_reset"

    shutil.copyfile(default_repo / DEFAULT_MODEL / "1" / "model.onnx", folder / "model.onnx")
    reseal(folder)
    eventually(lambda: reloads(mesh) == 2, "the fixed file is loaded again")
    assert _label_or_none(mesh, "I forgot my password") == "password_reset"
