"""Every container compose.mtls.yaml gives a secrets folder can read it: the files
deploy/compose/mtls-secrets.sh lays out are root-owned, group 10001, mode 0440 (folders 0750),
so a container reads them as root or as a member of group 10001. Jaeger's image runs as user
10001 in group 0, so without `group_add` its OTLP receiver could not read its key and every
span was lost. No container engine runs here: the users are the images' own, written below
from their build files, and the test reads the compose files as compose merges them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
SECRETS_GROUP = 10001  # mtls-secrets.sh's group

# (uid, gid) each image runs as when compose names no `user`.
IMAGE_USERS = {
    "${HOPLINE_IMAGE:-localhost/hopline:0.1.0}": (10001, 10001),  # deploy/image/Containerfile
    "jaegertracing/jaeger:2.12.0": (10001, 0),  # cmd/jaeger/Dockerfile: USER ${USER_UID}
    "milvusdb/milvus:v2.5.4": (0, 0),  # no USER: root
}


def merged_services() -> dict[str, dict[str, Any]]:
    """compose.yaml with compose.mtls.yaml over it, as compose merges services' keys."""
    services: dict[str, dict[str, Any]] = {}
    for name in ("compose.yaml", "compose.mtls.yaml"):
        document = yaml.safe_load((COMPOSE / name).read_text())
        for service, spec in document["services"].items():
            merged = services.setdefault(service, {})
            for key, value in spec.items():
                if isinstance(value, list) and isinstance(merged.get(key), list):
                    merged[key] = merged[key] + value
                else:
                    merged[key] = value
    return services


def reads_secrets(spec: dict[str, Any]) -> bool:
    uid, gid = IMAGE_USERS[spec["image"]]
    if "user" in spec:
        user, _, group = str(spec["user"]).partition(":")
        uid, gid = int(user), int(group or gid)
    groups = {gid, *(int(g) for g in spec.get("group_add", []))}
    return uid == 0 or SECRETS_GROUP in groups


def test_every_container_given_secrets_can_read_them() -> None:
    services = merged_services()
    given = {
        name: spec
        for name, spec in services.items()
        if any(str(v).startswith("./secrets/") for v in spec.get("volumes", []))
    }
    assert {"gateway", "cache", "jaeger", "milvus"} <= set(given)
    cannot = sorted(name for name, spec in given.items() if not reads_secrets(spec))
    assert cannot == [], f"cannot read their group-{SECRETS_GROUP} 0440 secrets: {cannot}"


def test_docker_leaves_out_what_podman_leaves_out() -> None:
    """Docker reads only .dockerignore (not .containerignore): without it, the README's
    `docker build` copied the CA's key, the compose secrets and api-keys.json into the
    build stage."""
    root = COMPOSE.parents[1]
    docker = (root / ".dockerignore").read_text().splitlines()
    assert docker == (root / ".containerignore").read_text().splitlines()
    assert {".hopline", "deploy/compose/secrets", "api-keys.json"} <= set(docker)
