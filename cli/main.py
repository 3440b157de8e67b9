"""The `hopline` command: serve a service, run the whole mesh, predict, build models."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from hopline.runtime import config as cfg
from hopline.runtime import grpc_io
from hopline.runtime.api_keys import API_KEY_ENV, UnsendableKey
from hopline.runtime.service_table import INPROC, SERVICES, Topology, spec

# Plain strings: argparse lists an enum member's repr (`<ServiceName.CACHE: 'cache'>`).
SERVICE_NAMES = tuple(s.name.value for s in SERVICES)
# `hopline model build`'s check limits, named as CheckLimits' fields.
LIMIT_FLAGS = {
    "min_label_agreement": "share of held-out texts whose label must match FP32's, 0 to 1",
    "max_accuracy_drop": "held-out accuracy the conversion may lose, 0 to 1 (0.005: half a point)",
    "min_cosine_mean": "mean embedding cosine to FP32, -1 to 1",
    "min_cosine": "embedding cosine to FP32, worst sentence, -1 to 1",
}


def _serve(name: str, argv: Sequence[str]) -> int:
    from hopline.observability.logs import setup_logging, without_passwords
    from hopline.observability.tracing import setup_tracing
    from hopline.runtime import event_loop
    from hopline.runtime.cpu_quota import (
        POOL_VARIABLES,
        fit_thread_pools,
        quota_cpus,
        usable_cpus,
    )
    from hopline.runtime.parent import LAUNCHER_ENV, follow_parent
    from hopline.runtime.server import serve
    from hopline.runtime.tls import TlsConfigError
    from hopline.runtime.workers import (
        WorkersConfigError,
        check,
        follow_supervisor,
        supervise,
        worker_index,
    )

    # Before numpy and `tokenizers` start their thread pools (a container's CPU limit).
    pools = fit_thread_pools()
    # Only this service's module is imported: `serve gateway` loads no ONNX Runtime or Milvus.
    config_cls, service_cls = spec(name).load()
    config = cfg.load(config_cls, argv, prog=f"hopline serve {name}")
    setup_logging(name, config.log_level, config.log_format)
    workers = getattr(config, "worker_processes", 1)
    if worker_index() is not None:
        follow_supervisor()
    elif LAUNCHER_ENV in os.environ:  # `hopline run`'s: it stops with it
        follow_parent(LAUNCHER_ENV, "hopline run")
    elif workers != 1:
        try:
            check(config.listen, workers, "HOPLINE_GATEWAY_WORKERS", _colocated_store_file(config))
        except WorkersConfigError as exc:
            logging.getLogger("hopline").error("cannot start workers", extra={"error": str(exc)})
            return 2
        return supervise(name, argv, workers, config.metrics_host, config.metrics_port)
    try:
        setup_tracing(name)
    except ValueError as exc:  # a sampler or export TLS setting that cannot work: do not start
        logging.getLogger("hopline").error("cannot set up tracing", extra={"error": str(exc)})
        return 2
    shown = without_passwords(vars(config))
    logging.getLogger("hopline").info("config", extra={"config": shown})
    # `pools`: what this process set; `pool_env`: the sizes in effect, also those a gateway
    # worker inherits from its supervisor or the operator set (it sets none of them itself).
    pool_env = {name: os.environ[name] for name in POOL_VARIABLES if name in os.environ}
    logging.getLogger("hopline").info(
        "cpus",
        extra={
            "usable": usable_cpus(),
            "quota": quota_cpus(),
            "pools": pools,
            "pool_env": pool_env,
        },
    )

    async def main() -> int:
        # Built inside the loop: grpc.aio channels bind to the loop that creates them.
        return await serve(service_cls(config), config)

    try:
        return event_loop.run(main, config.event_loop)
    except cfg.SettingError as exc:
        logging.getLogger("hopline").error("cannot start", extra={"error": str(exc)})
        return 2
    except TlsConfigError as exc:
        # The gateway reads its certificate to dial its upstreams while it is built, before
        # serve() binds: a key that is not its certificate's escaped as a SystemExit, its
        # message a bare line amid the JSON log (exit 1), where every other service says
        # "cannot serve TLS" as a JSON line and exits 2 (a logs probe).
        logging.getLogger("hopline").error(
            "cannot serve TLS", extra={"listen": getattr(config, "listen", ""), "error": str(exc)}
        )
        return 2


def _colocated_store_file(config: object) -> str:
    """The milvus-lite file a cache co-located in the gateway opens ("" when the cache is not
    co-located, or is on a Milvus server)."""
    if getattr(config, "cache_addr", "") != INPROC:
        return ""
    from hopline.cache.config import CacheConfig
    from hopline.cache.milvus_lite import is_local

    uri = cfg.load(CacheConfig, []).uri
    return uri if is_local(uri) else ""


def no_gateway_hint(address: str, flag: str, details: str = "") -> str:
    """What to say when nothing answers at `address` (`hopline predict`'s and `hopline
    bench`'s words): how the mesh starts, and `flag`, the command's way to name another.
    `details`, gRPC's, tell a plaintext call that a TLS server closed from a refusal."""
    from hopline.runtime.tls import CA_ENV

    if not os.environ.get(CA_ENV) and "Socket closed" in details:
        # A TLS server closes a plaintext connection before HTTP/2 begins; "no gateway
        # answered" sent the user looking for a mesh that was running (a security probe).
        return (
            f"something at {address} closed the plaintext connection before HTTP/2 began, as "
            f"a TLS gateway does: set {CA_ENV} to its CA file"
        )
    over = "TLS (HOPLINE_TLS_CA is set)" if os.environ.get(CA_ENV) else "plaintext"
    return (
        f"no gateway answered at {address} over {over}: `make run` starts the mesh; "
        f"{flag} or HOPLINE_GATEWAY_ADDR names another"
    )


def _predict(args: argparse.Namespace) -> int:
    from hopline.gateway.client import gateway_address, predict, to_json
    from hopline.runtime.errors import TRACE_ID_METADATA
    from hopline.runtime.ports import dial_problem
    from hopline.runtime.tls import TlsConfigError

    named_by = "--gateway" if args.gateway is not None else "HOPLINE_GATEWAY_ADDR"
    if problem := dial_problem(gateway_address(args.gateway), named_by):
        sys.stderr.write(f"hopline predict: error: {problem}\n")
        return 2
    try:
        response = predict(
            args.text,
            gateway=args.gateway,
            tenant=args.tenant,
            model=args.model,
            model_version=args.model_version,
            top_k=args.top_k,
            cache_mode=args.cache,
            timeout_s=args.timeout,
            api_key=args.api_key,
        )
    except (UnsendableKey, TlsConfigError) as err:  # said before anything is sent
        sys.stderr.write(f"hopline predict: error: {err}\n")
        return 2
    except grpc.RpcError as err:
        code = err.code()
        trailing = dict(getattr(err, "trailing_metadata", lambda: ())() or ())
        traced = trailing.get(TRACE_ID_METADATA)
        sys.stderr.write(
            f"error: {code.name}: {err.details()}" + (f" (trace {traced})" if traced else "") + "\n"
        )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            sys.stderr.write(f"(give your key with --api-key or {API_KEY_ENV})\n")
        elif code == grpc.StatusCode.UNAVAILABLE and not trailing:
            # A gateway's own UNAVAILABLE (an upstream down) carries its trailers.
            hint = no_gateway_hint(gateway_address(args.gateway), "--gateway", err.details() or "")
            sys.stderr.write(f"({hint})\n")
        return 1
    doc = to_json(response)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
        return 0
    hops = " | ".join(f"{hop} {ms:.2f}" for hop, ms in doc["timings_ms"].items())
    similarity = f" (similarity {doc['similarity']:.3f})" if doc["cache"] == "SEMANTIC" else ""
    lines = [
        f"label        {doc['label']}  (score {doc['score']:.3f})",
        *(f"  top        {s['label']} {s['score']:.3f}" for s in doc["top_k"][1:]),
        f"model        {doc['model']} v{doc['model_version']}",
        f"tenant       {doc['tenant']}",
        f"cache        {doc['cache']}{similarity}",
        f"timings ms   {hops}",
        # A gateway with OTEL_SDK_DISABLED makes no trace ids: an empty line read as lost.
        f"trace id     {doc['trace_id'] or '(none: the gateway runs with tracing off)'}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


class BuildStopped(BaseException):
    """SIGTERM during `hopline model build` (a BaseException: no handler of errors keeps it)."""


def _stopped(signum: int, frame: object) -> None:
    raise BuildStopped


def _model_build(args: argparse.Namespace) -> int:
    from hopline.model.build import (
        DEFAULT_MODEL_NAME,
        DEFAULT_REJECT_RATE,
        DEFAULT_TRAIN_FILE,
        build_model,
    )
    from hopline.model.limits import CheckLimits
    from hopline.model.providers import ProviderConfigError
    from hopline.model.quantize import Precision, PrecisionCheckError
    from hopline.observability.logs import LogFormat, setup_logging

    if args.default and args.train:  # --train was ignored, the default set built unsaid
        return _usage_error("model build", "give --train FILE --name NAME, or --default, not both")
    if (ignored := _ignored_build_flags(args)) is not None:
        return _usage_error("model build", ignored)
    if args.default:
        train, name = DEFAULT_TRAIN_FILE, args.name or DEFAULT_MODEL_NAME
    elif args.train:
        train, name = Path(args.train), args.name
        if not name:
            return _usage_error("model build", "--name is required with --train")
    else:
        return _usage_error("model build", "give --train FILE --name NAME, or --default")
    setup_logging("model-build", fmt=LogFormat.TEXT)
    check_sentences = Path(args.check_sentences) if args.check_sentences else None
    if check_sentences is not None and not check_sentences.is_file():
        # Said now, not after the minute of embedding and training before the check.
        sys.stderr.write(
            f"hopline model build: --check-sentences {check_sentences}: no such file\n"
        )
        return 2
    # A build stopped by SIGTERM left its staging folder (up to 90 MB) behind: raised here,
    # the builder's clean-up runs as for any failure.
    signal.signal(signal.SIGTERM, _stopped)
    try:
        target = build_model(
            train,
            name,
            Path(args.repo),
            version=args.version,
            split=args.split,
            oos_threshold=args.oos_threshold,
            in_scope_reject_rate=(
                DEFAULT_REJECT_RATE if args.reject_rate is None else args.reject_rate
            ),
            cache_mode=args.cache_mode,
            cache_threshold=args.cache_threshold,
            cache_min_score=args.cache_min_score,
            precision=Precision(args.precision),
            providers=args.providers.split(",") if args.providers else None,
            check_sentences=check_sentences,
            # Flags left unset keep CheckLimits' defaults: one source for each limit.
            check_limits=CheckLimits(
                **{
                    field: getattr(args, field)
                    for field in LIMIT_FLAGS
                    if getattr(args, field) is not None
                }
            ),
        )
    except BuildStopped:
        sys.stderr.write("hopline model build: stopped by SIGTERM; nothing published\n")
        return 128 + signal.SIGTERM
    except (PrecisionCheckError, ProviderConfigError, ValueError, OSError) as exc:
        # The builder's ValueErrors (TrainingDataError, a bad version) and OSErrors (a file
        # missing, a version that exists) are the user's to fix: one line, no traceback.
        said = str(exc)
        if isinstance(exc, FileNotFoundError) and exc.filename:
            said = f"{exc.filename}: no such file"
        sys.stderr.write(f"hopline model build: {said}\n")
        return 1
    info = json.loads((target / "config.json").read_text())
    line = (
        f"built {target}  precision={info['precision']} "
        f"labels={len(json.loads((target / 'labels.json').read_text()))} "
        f"cv_accuracy={info['build']['cv_accuracy']} oos_threshold={info['oos_threshold']}"
    )
    check = info["build"].get("precision_check")
    if check:
        line += (
            f" heldout_label_agreement={check['heldout_label_agreement']}"
            f" cosine_mean={check['cosine_mean']} cosine_min={check['cosine_min']}"
        )
    sys.stdout.write(line + "\n")
    return 0


def _ignored_build_flags(args: argparse.Namespace) -> str | None:
    """What the build would not read of the flags given, or None: each was ignored unsaid
    (`--default --split test` built the whole bundled set, an operator's probe)."""
    if args.default and args.split is not None:
        return "--split goes with --train (a JSON object of splits), not --default"
    if args.oos_threshold is not None and args.reject_rate is not None:
        return "--reject-rate calibrates the threshold that --oos-threshold fixes: give one"
    if args.precision == "fp32":
        checks = ["--check-sentences"] if args.check_sentences else []
        checks += [f"--{f.replace('_', '-')}" for f in LIMIT_FLAGS if getattr(args, f) is not None]
        if checks:
            return (
                f"{' and '.join(checks)} {'are' if len(checks) > 1 else 'is'} for an int8 or "
                "fp16 build (it checks the conversion against FP32); an fp32 build has nothing "
                "to check"
            )
    return None


def _usage_error(command: str, said: str) -> int:
    """A usage mistake argparse cannot see (flags that need each other): its line and exit
    status 2, as argparse's own."""
    sys.stderr.write(f"hopline {command}: error: {said}\n")
    return 2


def _run(args: argparse.Namespace) -> int:
    from hopline.cli.run import run_mesh
    from hopline.observability.logs import LogFormat

    formats = [f.value for f in LogFormat]
    if args.log_format not in formats:  # argparse checks a flag, not its default
        return _usage_error(
            "run",
            f"HOPLINE_LOG_FORMAT={args.log_format!r}: {' or '.join(formats)} (or --log-format)",
        )
    return run_mesh(
        Path(args.model_repo), log_format=args.log_format, topology=Topology(args.topology)
    )


def build_parser() -> argparse.ArgumentParser:
    from hopline.model.limits import CheckLimits  # plain dataclass: no numpy, no ONNX

    parser = argparse.ArgumentParser(prog="hopline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service (see `hopline serve NAME --help`)")
    serve.add_argument("service", choices=SERVICE_NAMES)

    from hopline.cli.arg_types import (
        cosine,
        model_version,
        providers,
        share,
        timeout_s,
        top_k,
        utf8_text,
    )
    from hopline.cli.run import DEFAULT_TOPOLOGY

    run = sub.add_parser("run", help="start the mesh locally (--topology), stop it on Ctrl-C")
    run.add_argument(
        "--model-repo",
        default=os.environ.get("HOPLINE_MODEL_REPO", "models"),
        help="the model repository, for every service [env HOPLINE_MODEL_REPO; default models]",
    )
    run.add_argument(
        "--log-format",
        default=os.environ.get("HOPLINE_LOG_FORMAT", "text"),
        choices=("text", "json"),
        help="every service's log, on this terminal [env HOPLINE_LOG_FORMAT; default text]",
    )
    run.add_argument(
        "--topology",
        default=DEFAULT_TOPOLOGY.value,
        choices=[t.value for t in Topology],
        help="colocated: tokenizer, inference and postprocess inside the gateway, the cache "
        "in its own process; one-process: the cache inside the gateway too (no cache address "
        "for operators); five-process: every service in its own process (default: "
        "%(default)s)",
    )

    pred = sub.add_parser("predict", help="classify one text through the gateway")
    pred.add_argument("text", type=utf8_text)
    pred.add_argument(
        "--gateway",
        help=f"gateway address [env HOPLINE_GATEWAY_ADDR; default {spec('gateway').default_addr}]",
    )
    pred.add_argument("--tenant", default="", type=utf8_text)
    pred.add_argument(
        "--api-key",
        help=f"your API key, for a gateway with API keys; it names your tenant [env {API_KEY_ENV}, "
        "which keeps the key out of the process list]",
    )
    pred.add_argument("--model", default="", type=utf8_text)
    pred.add_argument("--model-version", default="", type=utf8_text)
    pred.add_argument("--top-k", type=top_k, default=1)
    pred.add_argument("--cache", default="use", choices=("use", "bypass", "refresh"))
    pred.add_argument("--timeout", type=timeout_s, default=10.0, help="deadline in seconds")
    pred.add_argument("--json", action="store_true", help="one JSON object (stable keys)")

    model = sub.add_parser("model", help="model repository commands")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser("build", help="build a model version from labelled texts")
    build.add_argument("--train", help="JSON/JSONL of {text,label} or [text,label]")
    build.add_argument("--split", help="with --train: the split to use when the file holds several")
    build.add_argument("--name")
    build.add_argument("--default", action="store_true", help="the bundled support intents")
    build.add_argument("--repo", default="models")
    build.add_argument("--version", type=model_version, help="default: the next free integer")
    build.add_argument(
        "--oos-threshold",
        type=share(what=" (a score)"),
        help="fixed out-of-scope score threshold (default: calibrated)",
    )
    build.add_argument(
        "--reject-rate",
        type=share(one=False),
        help="share of held-out in-scope texts the calibrated threshold rejects (default: "
        "0.02; not with --oos-threshold, which fixes the threshold)",
    )
    build.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8", "fp16"),
        help="int8: dynamic quantization for CPUs; fp16: for GPUs. Either is checked against "
        "FP32 and refused (nothing published) if it strays past the limits below",
    )
    build.add_argument(
        "--providers",
        type=providers,
        help="execution providers, best first, comma-separated: tensorrt,cuda,cpu (default: "
        "cpu; fp16: tensorrt with an engine cache and FP16, cuda, cpu)",
    )
    build.add_argument(
        "--check-sentences",
        help="sentences for the embedding cosine check (reference JSON records, JSONL of "
        "{text}, or lines; default: ../shared/reference/minilm_reference.json if present)",
    )
    # Any number was taken: an agreement of 2 or a cosine of 1.5 refused every converted build
    # after its minutes of work, a negative accuracy drop asked it to beat FP32, and an
    # agreement below 0 checked nothing (an operator's probe).
    limit_types = {
        "min_label_agreement": share(what=" (a share of texts)"),
        "max_accuracy_drop": share(what=" (a share of texts)"),
        "min_cosine_mean": cosine,
        "min_cosine": cosine,
    }
    for field, what in LIMIT_FLAGS.items():
        build.add_argument(
            f"--{field.replace('_', '-')}",
            type=limit_types[field],
            help=f"{what} (default: {getattr(CheckLimits(), field)})",
        )
    build.add_argument("--cache-mode", default="exact", choices=("off", "exact", "semantic"))
    build.add_argument(
        "--cache-threshold",
        type=share(zero=False),
        default=0.9,
        help="cosine similarity a semantic hit needs (see `hopline cache calibrate`)",
    )
    build.add_argument(
        "--cache-min-score",
        type=share(what=" (a score)"),
        default=None,
        help="answers scoring below this are not cached (default: 0.3 with --cache-mode "
        "semantic, where a low-confidence answer replayed for paraphrases is the main source "
        "of cache-induced errors; 0 otherwise)",
    )

    # Imported here, not at the top: `hopline serve NAME` never builds this parser, so a
    # service process loads none of the tools' dependencies.
    from hopline.bench.command import add_bench_command
    from hopline.cache.cli import add_cache_commands
    from hopline.observability.trace_cli import add_trace_commands

    add_cache_commands(sub)
    add_trace_commands(sub)
    add_bench_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # the last lines' write fails here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        # Each long command's own clean-up has run (files are written whole or removed): a
        # traceback said nothing more (an operator's probe, in every long command).
        sys.stderr.write("hopline: stopped by Ctrl-C\n")
        return 130
    except BrokenPipeError:
        # The reader of our output is gone (`hopline trace report | head -1` said "error:
        # [Errno 32] Broken pipe", or a BrokenPipeError at the interpreter's exit): end as a
        # tool SIGPIPE kills, with a shell's status for it, as Ctrl-C ends with 130. stdout
        # goes to devnull first, else the interpreter's own flush at exit fails again (the
        # Python docs' way, in the signal module's note on SIGPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    grpc_io.check()
    # `serve NAME` hands the rest of the line to the service's own config parser.
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in SERVICE_NAMES:
        return _serve(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    if args.command == "predict":
        return _predict(args)
    if args.command == "model":
        return _model_build(args)
    if args.command == "run":
        return _run(args)
    if args.command == "cache":
        from hopline.cache.cli import run_cache_command

        return run_cache_command(args)
    if args.command == "trace":
        from hopline.observability.trace_cli import run_trace_command

        return run_trace_command(args)
    if args.command == "bench":
        from hopline.bench.cli import run_bench

        return run_bench(args)
    build_parser().parse_args([args.command, "--help"])
    return 2
