"""Output paths refused before the work (cli/outputs.py): `hopline bench --json` into a path
that cannot be written was found only after the whole run, in a traceback with nothing written
(`make bench`'s suite, a soak, `cache calibrate` and `trace report` likewise). Each command
here is stopped at its output check (exit 2, the flag named) before it dials or reads
anything: the bench's target is a port nothing listens on, and would fail otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopline.bench import soak, suite
from hopline.cli.main import main
from hopline.cli.outputs import output_problem, output_problems


def test_each_kind_of_unwritable_output_is_named(tmp_path: Path) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("")
    assert output_problem(tmp_path / "new" / "r.json", "--json") is None
    assert (tmp_path / "new").is_dir()  # made, as the writer would
    assert not (tmp_path / "new" / "r.json").exists()  # the file itself is left to the run
    assert (
        output_problem(tmp_path, "--json")
        == f"--json {tmp_path}: is a directory; it names the file to write"
    )
    assert output_problem(a_file, "--out", directory=True) == (
        f"--out {a_file}: is a file; it names a directory to write into"
    )
    under_a_file = output_problem(a_file / "x.png", "--png")
    assert under_a_file is not None
    assert under_a_file.startswith(f"--png {a_file / 'x.png'}: cannot create {a_file}:")
    assert output_problems((None, "--png"), (tmp_path, "--json")) == [
        f"--json {tmp_path}: is a directory; it names the file to write"
    ]


def _refused(capsys: pytest.CaptureFixture[str], code: int, flag: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{flag} " in err, err
    assert "error" in err, err
    return err


def test_bench_refuses_its_outputs_before_dialling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    target = ["bench", "--target", "127.0.0.1:9", "--baseline", "none", "--duration", "1"]
    code = main([*target, "--json", str(tmp_path / "afile" / "r.json")])
    assert "cannot create" in _refused(capsys, code, "--json")
    assert "is a directory" in _refused(capsys, main([*target, "--png", str(tmp_path)]), "--png")


def test_trace_report_and_calibrate_refuse_their_outputs_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Neither input exists: the output is refused before the input is read.
    missing = str(tmp_path / "missing.json")
    code = main(["trace", "report", "--file", missing, "--json", str(tmp_path)])
    assert "is a directory" in _refused(capsys, code, "--json")
    code = main(["cache", "calibrate", "--pairs", missing, "--png", str(tmp_path)])
    assert "is a directory" in _refused(capsys, code, "--png")


def test_suite_and_soak_refuse_their_outputs_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exited:
        suite.main(["--out", str(tmp_path / "afile"), "--no-peer"])
    assert "is a file" in _refused(capsys, int(str(exited.value.code)), "--out")
    code = soak.main(["--json", str(tmp_path), "--duration", "1"])
    assert "is a directory" in _refused(capsys, code, "--json")
