"""The garbage collector's settings for a service that has started.

CPython's collector stops the whole process while it walks the objects it tracks. A
service builds most of its objects once, at start-up (modules, protobuf descriptors, gRPC
and ONNX Runtime bindings, a tokenizer, the cache's index rebuilt from Milvus), and then
walks them again on every full collection, which the collector starts each time the objects
it tracks have grown by a quarter. Requests, meanwhile, allocate a few dozen short-lived
containers each, and the youngest generation is collected every 700 net allocations by
default, each pass also walking whatever requests are in flight.

So once a service is ready, `settle` frees what start-up left behind, moves everything still
alive out of the collector's reach for good (`gc.freeze`: those objects are never walked
again, and a cycle among them that became garbage later would never be freed: channels and
the Milvus client live until shutdown, and a model version loaded at start-up, which can be
removed while the service runs, holds no cycle, so reference counts free it
(services/inference/batched_model.py; tests/mesh/test_model_memory.py), and collects the
youngest generation less often.

Measured on the Intel Xeon VM (2 cores), three co-located meshes side by side, `hopline bench
--mix miss` in 5 alternated rounds of open loop at 290 rps and closed loop at c=32, the
collector timed by a callback in every process: as CPython leaves it, freezing alone, and
freezing with `GEN0_THRESHOLD` 5000.
- Open loop p99 by round: 91.8, 299.3, 106.1, 123.7, 118.1 ms as left; 83.7, 95.2, 107.6,
  99.0, 115.1 frozen; 91.0, 90.4, 95.2, 92.6, 91.2 frozen with 5000 (p50 35.8-59.3, 34.7-38.9,
  32.5-35.4 ms). Medians of p99/p50 3.01, 2.77, 2.69.
- c=32: 386.4, 378.9, 385.7 rps (medians): no change to throughput.
- The gateway's collector over the whole run: 3.20 s in all, longest pause 49 ms (38 full
  collections) as left; 2.27 s, 31 ms frozen; 0.36 s, 24 ms frozen with 5000. The cache
  process: 0.40 s, longest 109 ms as left; 0.09 s, 16 ms frozen with 5000.
An earlier run with GEN0_THRESHOLD 20000 spent as little but paused up to 39 ms at once.
"""

from __future__ import annotations

import gc

# Net allocations between two collections of the youngest generation (CPython's default: 700).
GEN0_THRESHOLD = 5000


def settle() -> None:
    """Collect, freeze what survives, and collect the youngest generation less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)
