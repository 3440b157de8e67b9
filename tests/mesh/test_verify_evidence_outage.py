"""The verifier (cache/verifier.py) over the shared evidence store of a real Milvus server
(milvus-lite's own process) that stops and comes back, as a Milvus pod restarts under the
cache replicas: a report taken while it is down is learnt at once and held, and written
with the next one once the server is back, so the peers and the next start see it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from milvus_server import MilvusKind, MilvusServer

from hopline.cache.shared_evidence import SharedEvidence
from hopline.cache.verifier import Verifier
from hopline.cache.verify import Decision, VerifyPolicy, scope_key
from hopline.protos.hopline.common.v1 import common_pb2

SCOPE = ("outage", "support-intents", "1", "{}")
POLICY = VerifyPolicy(target=0.01, confidence=0.9, prior_threshold=0.8, floor=0.5)


def test_a_report_taken_while_milvus_is_down_is_written_once_it_is_back(tmp_path: Path) -> None:
    server = MilvusServer(tmp_path / "milvus", MilvusKind.LITE_SERVER).start()

    async def body() -> None:
        verifier = Verifier(seed=1)
        await verifier.start(lambda: SharedEvidence(server.uri, "c", 2.0), "test")
        cached = common_pb2.Prediction(label="card_stolen")
        ids = []
        for _ in range(2):
            decision, verify_id, _ = verifier.decide(SCOPE, cached, 0.9, POLICY, "0+0")
            assert decision is Decision.SERVE_AND_VERIFY  # nothing known: every hit checked
            ids.append(verify_id)
        server.stop()
        lost = common_pb2.Prediction(label="card_lost")
        assert not await verifier.report(ids[0], lost)  # taken: the store is not needed
        assert verifier.rules.evidence(scope_key(SCOPE)).rule(POLICY).disagreements == 1
        server.start()
        assert not await verifier.report(ids[1], lost)
        await verifier.stop()

    try:
        asyncio.run(body())
        replayed = SharedEvidence(server.uri, "c", 10.0).replay()
        assert [row.obs.agreed for row in replayed] == [False, False]
    finally:
        server.stop()
