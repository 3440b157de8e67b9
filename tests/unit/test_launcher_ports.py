"""`hopline run` over a port another program listens on: it must refuse, naming the address,
not find the other program's services SERVING and report itself up (it did: "up in 0.0 s",
then its own services failed to bind). No process is started."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hopline.runtime.launcher import Mesh, MeshError, address_in_use
from hopline.runtime.service_table import spec


def test_a_mesh_over_a_busy_address_refuses_to_start_and_names_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        assert address_in_use(address)
        mesh = Mesh(tmp_path, addrs={"cache": address})
        with pytest.raises(MeshError) as refused:
            mesh.start(("cache",))
        named = f"address in use: cache on {address} ({spec('cache').addr_env})"
        assert named in str(refused.value)
        assert mesh.procs == {}
    assert not address_in_use(address)
