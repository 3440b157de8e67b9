"""runtime/collector.py: once a service is ready, what start-up built is out of the garbage
collector's reach and the youngest generation is collected less often.

Run in a child interpreter: `settle` changes the collector of the process that calls it."""

from __future__ import annotations

import json
import subprocess
import sys

from hopline.runtime.collector import GEN0_THRESHOLD

CHILD = """
import gc, json
from hopline.runtime import collector
held = [[i] for i in range(20000)]  # start-up state: lists, which the collector tracks
gc.collect()
before = len(gc.get_objects())
collector.settle()
late = [[i] for i in range(100)]  # what arrives after start-up is still collected
print(json.dumps({
    "before": before,
    "after": len(gc.get_objects()),
    "frozen": gc.get_freeze_count(),
    "threshold": gc.get_threshold(),
    "late_tracked": all(gc.is_tracked(x) for x in late),
    "held": len(held),
}))
"""


def test_settle_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(done.stdout)
    assert got["before"] > 20000
    # What start-up built (the 20,000 rows included) is no longer walked by a collection.
    assert got["frozen"] >= got["before"] - 100
    assert got["after"] < 1000
    assert got["late_tracked"]
    assert got["threshold"][0] == GEN0_THRESHOLD
