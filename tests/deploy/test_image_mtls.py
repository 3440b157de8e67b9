"""The image as the production overlay runs it (deploy/k8s/components/mtls), as containers:
each service holds only its own certificate, key and the CA, mounted read-only at
/etc/hopline/tls and readable by the image's group alone (a Secret's `defaultMode: 0440`
under `fsGroup: 10001`; here laid out by deploy/compose/mtls-secrets.sh, whose folders
deploy/compose/compose.mtls.yaml mounts the same way), and the gateway its API keys; probes
reach the plaintext health port (HOPLINE_HEALTH_PORT), as Kubernetes' gRPC probes do; the
services call each other over mTLS, and a client reaches the front door over TLS with an
API key.

Kubernetes' own rollout test (`make k8s-rollout`) runs no container (kwok's nodes are
fake), so this is where the overlay's settings meet the image's processes. Ports differ per
container only because they share the host's network here; in a pod each has its own.
Run by `make image-smoke` (see test_image_smoke.py for what it needs).
"""

from __future__ import annotations

import json
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from containers import (
    IMAGE_UID,
    container_names,
    podman,
    remove,
    require_image,
    start,
    stop_cleanly,
    stored,
    wait_serving,
)
from harness import SERVING, free_port, health
from hopline.cli.certs import DEPLOY_NAMES, ROLES, make_certs
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.service_table import SERVICES, ServiceName
from hopline.runtime.tls import OPERATOR, ClientTls, TlsFiles, channel, client_tls

GATEWAY = ServiceName.GATEWAY
TLS_DIR, KEYS_DIR = "/etc/hopline/tls", "/etc/hopline/api-keys"  # the component's mounts
API_KEY = "acme-image-mtls-3b9e"
SECRETS_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "mtls-secrets.sh"
TEXT = "my card was charged twice for the same order"


@dataclass
class Production:
    addrs: dict[str, str]  # service -> its own (TLS-only) address
    probes: dict[str, str]  # service -> its plaintext health address
    names: dict[str, str]  # service -> container
    certs: Path  # the CA and every role's certificate, on the host
    secrets: Path  # deploy/compose/mtls-secrets.sh's folders, one mounted in each container


def lay_out_secrets(certs: Path, keys: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """deploy/compose/mtls-secrets.sh: a folder per service as compose.mtls.yaml mounts it
    (and as Kubernetes mounts a Secret with defaultMode 0440 under fsGroup 10001)."""
    return subprocess.run(
        [str(SECRETS_SCRIPT), str(certs), str(keys), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def production(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Production]:
    require_image()
    work = tmp_path_factory.mktemp("image-mtls")
    certs = make_certs(work / "ca", (*ROLES, *DEPLOY_NAMES))
    keys = work / "keys.json"
    keys.write_text(json.dumps({API_KEY: "acme"}), encoding="utf-8")
    names = container_names("mtls")
    addrs = {str(s.name): f"127.0.0.1:{free_port()}" for s in SERVICES}
    probes = {str(s.name): free_port() for s in SERVICES}
    shared = {
        "HOPLINE_TLS_CERT": f"{TLS_DIR}/tls.crt",
        "HOPLINE_TLS_KEY": f"{TLS_DIR}/tls.key",
        "HOPLINE_TLS_CA": f"{TLS_DIR}/ca.crt",
        "HOPLINE_METRICS_PORT": "0",
        "HOPLINE_DRAIN_DELAY_S": "0.2",
    }
    laid_out = lay_out_secrets(certs, keys, work / "secrets")
    assert laid_out.returncode == 0, laid_out.stderr
    try:
        for service in SERVICES:
            env = {**shared, "HOPLINE_HEALTH_PORT": str(probes[service.name])}
            mounts = ["-v", f"{work / 'secrets' / service.name}:{TLS_DIR}:ro"]
            if service.name == GATEWAY:
                env |= {f"HOPLINE_{name.upper()}_ADDR": addr for name, addr in addrs.items()}
                env["HOPLINE_API_KEYS"] = f"{KEYS_DIR}/keys.json"
                mounts += ["-v", f"{work / 'secrets' / 'api-keys'}:{KEYS_DIR}:ro"]
            else:
                env[f"HOPLINE_{service.name.upper()}_ADDR"] = addrs[service.name]
            start(names[service.name], service.name, env, mounts)
        for service in SERVICES:
            wait_serving(f"127.0.0.1:{probes[service.name]}", names[service.name])
        yield Production(
            addrs,
            {k: f"127.0.0.1:{port}" for k, port in probes.items()},
            names,
            certs,
            work / "secrets",
        )
    finally:
        remove(list(names.values()))


def as_role(certs: Path, role: str | None, server: str) -> ClientTls:
    """Dial `server` trusting the mesh's CA, presenting `role`'s certificate (None: none)."""
    cert, key = (str(certs / f"{role}.crt"), str(certs / f"{role}.key")) if role else ("", "")
    tls = client_tls(TlsFiles(cert, key, str(certs / "ca.crt")), server)
    assert tls is not None
    return tls


def test_probes_answer_in_plaintext_and_the_services_only_over_mtls(
    production: Production,
) -> None:
    for service in SERVICES:
        name = str(service.name)
        assert health(production.probes[name]) == SERVING, name
        assert health(production.addrs[name]) is None, f"{name} answered plaintext"
        operator = as_role(production.certs, OPERATOR, name)
        assert health(production.addrs[name], tls=operator) == SERVING, name
        if name != GATEWAY:  # only the gateway's front door takes clients without a certificate
            anonymous = as_role(production.certs, None, name)
            assert health(production.addrs[name], tls=anonymous) is None, name


def test_the_secrets_script_lays_out_what_only_the_image_group_reads(
    production: Production, tmp_path: Path
) -> None:
    folders = {str(service.name): "ca.crt tls.crt tls.key" for service in SERVICES}
    # Jaeger's OTLP receiver's and Milvus's certificates, Milvus's configuration with the root
    # password, root's token (for the one-shot milvus-cache-user alone), the cache's own
    # user's token.
    folders |= {
        "jaeger": "ca.crt tls.crt tls.key",
        "milvus": "ca.crt tls.crt tls.key",
        "milvus-config": "user.yaml",
        "milvus-root": "token",
        "milvus-token": "token",
    }
    for name, files in folders.items():
        folder = production.secrets / name
        assert sorted(p.name for p in folder.iterdir()) == files.split(), name
        for path in (folder, *folder.iterdir()):
            info = path.stat()
            assert (info.st_uid, info.st_gid) == (0, int(IMAGE_UID)), path
            assert stat.S_IMODE(info.st_mode) == (0o750 if path.is_dir() else 0o440), path
    root_password = production.secrets / "milvus-root-password"
    cache_password = production.secrets / "milvus-cache-password"
    for made in (root_password, cache_password):
        assert stat.S_IMODE(made.stat().st_mode) == 0o600  # root's alone
    password = root_password.read_text().strip()
    token = (production.secrets / "milvus-root" / "token").read_text()
    assert (len(password), token) == (48, f"root:{password}\n")
    cache_token = (production.secrets / "milvus-token" / "token").read_text()
    assert cache_token == f"hopline_cache:{cache_password.read_text().strip()}\n"
    assert password not in cache_token
    user_yaml = (production.secrets / "milvus-config" / "user.yaml").read_text()
    assert f'defaultRootPassword: "{password}"' in user_yaml
    missing = lay_out_secrets(tmp_path / "no-certs", tmp_path / "keys.json", tmp_path / "out")
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr
    assert "make certs" in missing.stderr
    assert not (tmp_path / "out").exists()


def test_each_container_holds_only_its_own_key(production: Production) -> None:
    for service in SERVICES:
        container = production.names[service.name]
        listing = podman("exec", container, "ls", "-A", TLS_DIR).split()
        assert sorted(listing) == ["ca.crt", "tls.crt", "tls.key"], service.name
        assert podman("exec", container, "id", "-u") == IMAGE_UID, service.name
        holds_keys = podman("exec", container, "sh", "-c", f"test -e {KEYS_DIR} && echo y || true")
        assert (holds_keys == "y") == (service.name == GATEWAY), service.name


def predict(production: Production, key: str | None) -> gateway_pb2.PredictResponse:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    front_door = as_role(production.certs, None, GATEWAY)
    with channel(production.addrs[GATEWAY], front_door) as chan:
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(chan).Predict(
            gateway_pb2.PredictRequest(text=TEXT), metadata=metadata, timeout=60
        )
        return reply


def test_the_front_door_answers_over_tls_with_a_key_and_the_cache_over_mtls(
    production: Production,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        predict(production, None)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    first = predict(production, API_KEY)
    assert first.prediction.label
    assert first.cache.outcome == common_pb2.CACHE_OUTCOME_MISS  # tokenizer, model, postprocess
    assert first.tenant == "acme"
    # The gateway's store reached the cache container over mTLS: asked there as an operator.
    operator = as_role(production.certs, OPERATOR, ServiceName.CACHE)
    with channel(production.addrs[ServiceName.CACHE], operator) as to_cache:
        assert stored(to_cache, first, TEXT).prediction.label == first.prediction.label
    again = predict(production, API_KEY)
    assert again.cache.outcome == common_pb2.CACHE_OUTCOME_EXACT
    assert again.prediction.label == first.prediction.label


def test_each_container_drains_to_exit_code_zero(production: Production) -> None:
    for service in reversed(SERVICES):  # the gateway first, as a rollout would
        stop_cleanly(production.names[service.name], service.name)
