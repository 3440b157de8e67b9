"""`hopline model build`'s hold on the version it publishes (model/build_claim.py): two
builds of one version ran a minute and more each, then the second failed at the rename; two
builds picking the next version picked the same one; a killed build's staging folder stayed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hopline.model.build_claim import VersionBusyError, claimed, staging_dir


def test_a_named_version_another_build_holds_is_refused_at_once(tmp_path: Path) -> None:
    with claimed(tmp_path, "m", "2") as held:
        assert held == "2"
        refused = pytest.raises(VersionBusyError, match="version 2 of m is being built")
        with refused, claimed(tmp_path, "m", "2"):
            pass
    with claimed(tmp_path, "m", "2") as again:  # let go: a later build may take it
        assert again == "2"


def test_a_picked_version_moves_past_the_ones_being_built(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    with claimed(tmp_path, "m", None) as first, claimed(tmp_path, "m", None) as second:
        assert (first, second) == ("2", "3")


def test_a_version_published_while_waiting_is_not_built_again(tmp_path: Path) -> None:
    """The build that held the version published it: the next one finds it under the lock."""
    with claimed(tmp_path, "m", None) as first:
        (tmp_path / "m" / first).mkdir()
    assert not list((tmp_path / "m").glob(".build-*"))
    refused = pytest.raises(FileExistsError, match="model versions are immutable")
    with refused, claimed(tmp_path, "m", first):
        pass
    with claimed(tmp_path, "m", None) as picked:
        assert picked == "2"


def test_a_version_the_services_would_never_serve_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without leading zeros"), claimed(tmp_path, "m", "01"):
        pass


def test_a_dead_builds_staging_folder_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    """A build's folder is live while its version's lock is held, whichever pid namespace
    the build runs in: judged by process id, a build in another container sharing the
    repository lost its folder to the next build's sweep (a reviewer's probe)."""
    model = tmp_path / "m"
    gone = model / ".staging-4-999999999"  # its build was killed: nothing holds version 4
    (gone / "sub").mkdir(parents=True)
    with claimed(tmp_path, "m", "5") as live_version:
        live = staging_dir(model, live_version)
        live.mkdir()
        foreign = model / ".staging-5-1"  # a pid this process cannot see, its lock held
        foreign.mkdir()
        with claimed(tmp_path, "m", None):
            pass
        assert not gone.exists()
        assert live.exists()
        assert foreign.exists()
    assert live.name == f".staging-5-{os.getpid()}"
