"""`hopline run` takes its model repository from HOPLINE_MODEL_REPO, as the services it starts
and `hopline cache` do; it read only --model-repo (default `models`), so with the variable set
and no ./models it stopped with "no model repository" (a helper following the README)."""

from __future__ import annotations

import pytest

from hopline.cli.main import build_parser


def test_run_reads_the_model_repository_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOPLINE_MODEL_REPO", "/srv/models")
    assert build_parser().parse_args(["run"]).model_repo == "/srv/models"
    flag = build_parser().parse_args(["run", "--model-repo", "here"]).model_repo
    assert flag == "here"


def test_run_defaults_to_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOPLINE_MODEL_REPO", raising=False)
    assert build_parser().parse_args(["run"]).model_repo == "models"
