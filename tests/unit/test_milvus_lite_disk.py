"""A milvus-lite file on a nearly full disk is not written to, and the refusal says why.

milvus-lite's server answered a write on a full disk with gRPC's "Unexpected error in RPC
handling" (the reason, "database or disk is full", only in its own log), and answered most
such inserts as written while keeping none of them; so with less than LOW_DISK_BYTES free the
store refuses the write itself, naming the disk. The disk is a real one: a 4 MiB tmpfs
mounted in a mount namespace the test creates for a child process (`unshare`), with a real
milvus-lite server on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hopline.cache import milvus_lite

FILL = """
import sys, time
from pathlib import Path
import numpy as np
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.store import CacheStoreError, Entry

store = MilvusStore(str(Path(sys.argv[1]) / "cache.db"), "full_disk", 384, timeout_s=1.0)
now, vector = time.time(), np.full(384, 0.05, dtype=np.float32)
try:
    for batch in range(100):
        store.upsert([
            (Entry(f"{batch:032x}{i:032x}", ("t", "m", "1", "{}"), "text " * 50, b"x" * 2000,
                   now, now + 3600), vector)
            for i in range(200)
        ])
    print("every write landed")
except CacheStoreError as exc:
    print(f"refused: {exc}")
finally:
    store.close()
"""


def test_a_write_refused_for_a_full_disk_says_the_disk_is_full(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    fill = tmp_path / "fill.py"
    fill.write_text(FILL)
    script = (
        f'mount -t tmpfs -o size=4m tmpfs "{disk}" && exec "{sys.executable}" "{fill}" "{disk}"'
    )
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip()
    assert out.startswith("refused: "), out
    assert "not written (the disk holding" in out  # before milvus-lite could lose the rows
    assert f"the disk holding {disk}/cache.db has " in out
    assert "KiB free: probably full" in out
    assert "HOPLINE_CACHE_URI" in out


def test_a_disk_with_room_adds_nothing(tmp_path: Path) -> None:
    # The note is for a nearly full disk only: a write that fails for another reason on a
    # disk with room must not send the operator to free space.
    assert milvus_lite.disk_note(tmp_path / "cache.db") == ""
