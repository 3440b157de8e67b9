"""A version's files changed in place while the mesh serves: each service reloads them on
its own, so for a while one stage may answer from the old files and another from the new.
Such an answer must not be cached under the scope's digest (it would be replayed for the
entry's TTL, hours after every service has the new files).

The stages disagree here for as long as the test needs: postprocess re-reads the repository
only hourly, while the gateway re-reads the model list (and with it inference, which loads
changed files before it lists them) twice a second. In production the window is a refresh
period, and a disagreement that lasts (a new labels.json beside a model.onnx inference
cannot load, which it then serves on without) lasts as long as the files do."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from conftest import DEFAULT_MODEL
from harness import Mesh, eventually
from hopline.gateway.client import predict
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2

MISS = common_pb2.CACHE_OUTCOME_MISS


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


def test_an_answer_mixing_old_and_new_files_of_a_version_is_not_cached(mesh: Mesh) -> None:
    before = ask(mesh, "I forgot my password", cache="bypass")
    assert before.prediction.label == "password_reset"
    labels_file = mesh.repo / DEFAULT_MODEL / "1" / "labels.json"
    labels: list[str] = json.loads(labels_file.read_text())
    i, j = labels.index("password_reset"), labels.index("order_status")
    labels[i], labels[j] = labels[j], labels[i]
    staged = labels_file.with_name("labels.staged")
    staged.write_text(json.dumps(labels))
    staged.replace(labels_file)  # in place, as a sync of the version folder does
    eventually(
        lambda: (
            ask(mesh, "I forgot my password", cache="bypass").model_digest != before.model_digest
        ),
        "the gateway's model list and inference have the new files",
    )

    text = "I forgot my password and the reset link never came"
    first = ask(mesh, text)
    assert first.cache.outcome == MISS
    # Postprocess still labels with the old files: the answer mixes two builds.
    assert first.prediction.label == "password_reset"
    mesh.settle()
    again = ask(mesh, text)

    assert again.cache.outcome == MISS, "a mixed answer was cached under the new digest"
    # The two requests that would have stored; not the BYPASS ones above, which never store.
    assert stores(mesh, "skipped_files_differ") == 2
    log = (mesh.workdir / "gateway.log").read_text()
    assert log.count("a stage answered from other model files than the model list's") == 1
