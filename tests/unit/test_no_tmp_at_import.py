"""No temporary folder is needed to import hopline's commands: a Kubernetes pod with a
read-only root and nothing mounted on /tmp (the production overlay's milvus-cache-user Job)
failed `hopline cache milvus-user`, even its --help, with "No usable temporary directory
found" raised while importing runtime/ports.py (a deploy probe). A subprocess is not
started here: tempfile's search is made to fail in this process, as it does in such a pod."""

from __future__ import annotations

import importlib
import tempfile

import pytest

from hopline.runtime import ports


def test_the_port_claims_folder_is_not_looked_for_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def nowhere() -> str:
        raise FileNotFoundError("No usable temporary directory found in ['/tmp', '/var/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", nowhere)
    reloaded = importlib.reload(ports)
    try:
        # And a port is still granted (unclaimed) where no claim can be written.
        port = reloaded.free_ports(1)[0]
        assert 0 < port < 65536
    finally:
        monkeypatch.undo()
        importlib.reload(ports)
