"""A version's files changed as a new build would change them, for tests that write them in
place: config.json's checksums written again to match (`hopline model build` writes them;
model/repository.py:checksum_problem refuses a folder whose files are not the ones they
name, as while a copy over it is under way). Without it such a change reads as a copy
still under way, and the version serves its old files."""

from __future__ import annotations

import json
from pathlib import Path

from hopline.model.repository import CHECKSUMS, CONFIG_FILE, file_checksums


def reseal(folder: Path) -> None:
    config = json.loads((folder / CONFIG_FILE).read_text())
    config[CHECKSUMS] = file_checksums(folder, config["files"])
    staged = folder / "config.staged"
    staged.write_text(json.dumps(config))
    staged.replace(folder / CONFIG_FILE)
