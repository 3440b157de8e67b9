"""The local overlay sets a replica count only for Deployments no autoscaler owns: a count
in the manifest resets an autoscaled one at every `kubectl apply` (deploy/README.md), and the
local overlay set one for all five while keeping four autoscalers (a deploy probe)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_a_count_is_set_only_where_no_autoscaler_owns_it() -> None:
    overlay = _documents(DEPLOY / "overlays" / "local" / "kustomization.yaml")[0]
    autoscaled = {
        d["spec"]["scaleTargetRef"]["name"]
        for path in (DEPLOY / "base").glob("*.yaml")
        for d in _documents(path)
        if d.get("kind") == "HorizontalPodAutoscaler"
    }
    deleted = set()
    for patch in overlay.get("patches", []):
        target = patch.get("target", {})
        body = yaml.safe_load(patch.get("patch", "")) or {}
        if (
            target.get("kind") == "HorizontalPodAutoscaler"
            and isinstance(body, dict)
            and body.get("$patch") == "delete"
        ):
            deleted.add(target["name"])
    counted = {r["name"] for r in overlay.get("replicas", [])}
    assert autoscaled, "no autoscaler found in the base: nothing checked"
    assert counted & (autoscaled - deleted) == set()
    assert "cache" in counted  # milvus-lite: exactly one
