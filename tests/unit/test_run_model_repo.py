"""`hopline run` takes its model repository from HOPLINE_MODEL_REPO, as the services it starts
and `hopline cache` do; it read only --model-repo (default `models`), so with the variable set
and no ./models it stopped with "no model repository" (a helper following the README). Its
log format likewise from HOPLINE_LOG_FORMAT."""

from __future__ import annotations

import pytest

from hopline.cli.main import build_parser, main


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


def test_run_reads_the_log_format_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """HOPLINE_LOG_FORMAT, which every service reads, is `hopline run`'s too: it passed its own
    --log-format (default text) to every service, over the variable (a helper following the
    README's "flags win over env vars, env vars over defaults")."""
    monkeypatch.delenv("HOPLINE_LOG_FORMAT", raising=False)
    assert build_parser().parse_args(["run"]).log_format == "text"
    monkeypatch.setenv("HOPLINE_LOG_FORMAT", "json")
    assert build_parser().parse_args(["run"]).log_format == "json"
    assert build_parser().parse_args(["run", "--log-format", "text"]).log_format == "text"
    monkeypatch.setenv("HOPLINE_LOG_FORMAT", "xml")
    assert main(["run"]) == 2
    assert "HOPLINE_LOG_FORMAT='xml': json or text" in capsys.readouterr().err
