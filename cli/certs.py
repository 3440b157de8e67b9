"""`make certs`: a local CA and one certificate per role, for `make run` over TLS.

    python -m hopline.cli.certs .hopline/tls [--deploy] [--role NAME ...]

writes `ca.crt` (and `ca.key`), then `<role>.crt` and `<role>.key` for each service and for
`operator` (the CLI tools and the launcher's probes). Each certificate names its role as its
common name and as a DNS name, which is what a client checks when it dials that service and
what an internal service checks before serving a caller (hopline.runtime.tls); `localhost`
and `127.0.0.1` are added so other tools (grpcurl) can dial loopback too. Existing files are
kept: running it again only adds what is missing. Uses the `openssl` command; for local use
and tests, not for production keys.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from hopline.cli.arg_types import positive
from hopline.runtime.service_table import SERVICES
from hopline.runtime.tls import OPERATOR

ROLES: tuple[str, ...] = (*(str(s.name) for s in SERVICES), OPERATOR)
# The servers deploy/ runs beside the services, by role, with the DNS names their clients dial
# beyond the role's own (`--deploy`): the production overlay's Milvus, and the tracing
# pipeline's tiers (deploy/observability), which the services reach from another namespace.
DEPLOY_NAMES: dict[str, tuple[str, ...]] = {
    "milvus": (),
    "otel-loadbalancer": ("otel-loadbalancer.observability.svc.cluster.local",),
    "otel-tail-sampling": (),
    "jaeger-collector": ("jaeger",),  # compose's Jaeger is `jaeger`
}
DAYS = 365
# P-256: the smallest key and quickest handshake that every TLS stack accepts.
KEY_ALGORITHM = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def make_ca(folder: Path, days: int = DAYS) -> None:
    if (folder / "ca.crt").exists():
        return
    _openssl(
        "req", "-x509", *KEY_ALGORITHM,
        "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.crt"),
        "-days", str(days), "-subj", "/CN=hopline local CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _private(folder / "ca.key")


def make_leaf(folder: Path, role: str, days: int = DAYS, names: Iterable[str] = ()) -> None:
    """`<role>.crt` and `.key`, signed by the folder's CA, for serving and for calling; `names`
    are DNS names it carries beside the role's."""
    if (folder / f"{role}.crt").exists():
        return
    dns = "".join(f",DNS:{name}" for name in names)
    extensions = "\n".join(
        [
            f"subjectAltName=DNS:{role}{dns},DNS:localhost,IP:127.0.0.1",
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth,clientAuth",
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "leaf.csr", Path(tmp) / "leaf.ext"
        ext.write_text(extensions + "\n")
        _openssl(
            "req", *KEY_ALGORITHM, "-keyout", str(folder / f"{role}.key"),
            "-out", str(csr), "-subj", f"/CN={role}",
        )  # fmt: skip
        _private(folder / f"{role}.key")
        _openssl(
            "x509", "-req", "-in", str(csr),
            "-CA", str(folder / "ca.crt"), "-CAkey", str(folder / "ca.key"),
            "-CAcreateserial", "-out", str(folder / f"{role}.crt"),
            "-days", str(days), "-extfile", str(ext),
        )  # fmt: skip


def make_certs(folder: Path, roles: Iterable[str] = ROLES, days: int = DAYS) -> Path:
    """A CA in `folder` (kept if there) and a certificate for each role; returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    make_ca(folder, days)
    for role in roles:
        make_leaf(folder, role, days, DEPLOY_NAMES.get(role, ()))
    return folder


def env_for(folder: Path) -> dict[str, str]:
    """The HOPLINE_TLS_* settings that run a whole mesh (and its CLI) from `folder`."""
    return {
        "HOPLINE_TLS_CA": str(folder / "ca.crt"),
        "HOPLINE_TLS_CERT": str(folder / "{name}.crt"),
        "HOPLINE_TLS_KEY": str(folder / "{name}.key"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hopline.cli.certs", description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--role", action="append", default=[], help="another certificate to issue (repeatable)"
    )
    parser.add_argument(
        "--deploy",
        action="store_true",
        help=f"also the servers deploy/ runs: {', '.join(DEPLOY_NAMES)}",
    )
    # openssl refused 0 or less at the first certificate: a traceback, an empty folder made.
    parser.add_argument("--days", type=positive(int), default=DAYS)
    args = parser.parse_args(argv)
    deploy = tuple(DEPLOY_NAMES) if args.deploy else ()
    folder = make_certs(args.folder, (*ROLES, *deploy, *args.role), args.days)
    sys.stdout.write(f"certificates in {folder}; run the mesh over TLS with:\n")
    for key, value in env_for(folder).items():
        sys.stdout.write(f"  export {key}='{value}'\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
