"""`hopline cache calibrate --check-pairs`: the chosen threshold measured on pairs the
calibration never saw (the other half of a data set), printed and written to --json. The
pairs carry their similarities, so no encoder runs; the CLI runs as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hopline.cache.pairs import Pair, write_pairs


def test_check_pairs_are_measured_at_the_chosen_threshold(tmp_path: Path) -> None:
    calibrate, check, out = tmp_path / "cal.jsonl", tmp_path / "check.jsonl", tmp_path / "c.json"
    write_pairs(
        [Pair(f"q{i}", f"c{i}", True, "a", "a", 0.95 - i / 100) for i in range(40)]
        + [Pair(f"w{i}", f"d{i}", False, "a", "b", 0.30 - i / 100) for i in range(10)],
        calibrate,
    )
    held = [Pair(f"h{i}", f"e{i}", True, "a", "a", 0.9 - i / 50) for i in range(20)]
    held += [Pair(f"x{i}", f"f{i}", False, "a", "b", 0.6 - i / 20) for i in range(10)]
    write_pairs(held, check)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "cache",
            "calibrate",
            "--pairs",
            str(calibrate),
            "--target-false-hit-rate",
            "0.1",
            "--check-pairs",
            str(check),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    threshold = doc["check"]["threshold"]
    hits = [p for p in held if (p.similarity or 0.0) >= threshold]
    wrong = [p for p in hits if not p.same]
    assert doc["check"]["hits"] == len(hits) > 0
    assert doc["check"]["false_hits"] == len(wrong) > 0
    assert doc["check"]["false_hit_rate"] == round(len(wrong) / len(hits), 4)
    assert doc["check"]["pairs"] == len(held)
    assert f"check pairs false-hit  {len(wrong) / len(hits):.4f}" in run.stdout
