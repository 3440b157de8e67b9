"""`hopline cache ...`: offline tools for the semantic cache (labelled pairs, calibration)."""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from hopline.cache.invalidate_cli import add_invalidate
from hopline.cache.stats_cli import add_stats
from hopline.cli.arg_types import share
from hopline.cli.outputs import output_problem

if TYPE_CHECKING:
    from hopline.cache.cross_validation import CrossValidation
    from hopline.cache.embedder import Embedder
    from hopline.cache.pairs import Pair
    from hopline.model.repository import ModelConfig

Examples = list[tuple[str, str]]

DEFAULT_HOLDOUT = 0.5
DEFAULT_SEED = 0
DEFAULT_OOS_LABEL = "oos"

_WORK_DIR_HELP = "where the embedding encoder is built and kept [env HOPLINE_CACHE_DIR]"

# How far a pairs file's similarity may stray outside -1..1: float32 unit vectors' dot
# products overshoot 1 by rounding (about 1e-7), which is still a cosine; anything further
# came from something else, and its calibrated threshold would be one `model build` refuses.
_COSINE_SLACK = 1e-5


class UsageError(ValueError):
    """A flag's value that only turns out wrong once the command looks at its data: said as
    argparse says a bad flag (exit 2, one line naming the flag)."""


def _whole(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low`, else argparse's own error line."""

    def parse(raw: str) -> int:
        value = int(raw)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {raw}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def _split_names(raw: str) -> list[str]:
    """An argparse type: comma-separated split names, each once (a split named twice had its
    queries counted twice, which weighs the calibration towards them)."""
    names = [name for name in raw.split(",") if name]
    if not names:
        raise argparse.ArgumentTypeError(f"needs at least one split name, got {raw!r}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise argparse.ArgumentTypeError(
            f"names {', '.join(twice)} more than once: each split's queries count once"
        )
    return names


def add_cache_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser(
        "cache",
        help="semantic cache tools (pairs, calibration, evaluation, invalidation, stats)",
    )
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    work_dir = os.environ.get("HOPLINE_CACHE_DIR", ".hopline")

    pairs = cache_sub.add_parser(
        "pairs", help="labelled (query, nearest cached text) pairs from a labelled data set"
    )
    source = pairs.add_mutually_exclusive_group(required=True)
    source.add_argument("--clinc", type=Path, help="a JSON object of splits of [text, label]")
    source.add_argument(
        "--train", type=Path, help="JSON/JSONL of {text,label} or [text,label], split by --holdout"
    )
    pairs.add_argument("--store-split", help="with --clinc: the cached texts (default: train)")
    pairs.add_argument(
        "--query-splits",
        type=_split_names,
        help="with --clinc: comma-separated query splits, each named once (default: val,oos_val)",
    )
    pairs.add_argument(
        "--split", help="with --train: the split to read from a JSON object of splits"
    )
    # --holdout, --seed and --oos-label default to None: given where nothing reads them (with
    # --clinc; with --model), they are refused (_pairs), not ignored.
    pairs.add_argument(
        "--holdout",
        type=share(zero=False, one=False),
        help=f"with --train: share of each label queried (default: {DEFAULT_HOLDOUT})",
    )
    pairs.add_argument(
        "--seed", type=int, help=f"with --train: the split's seed (default: {DEFAULT_SEED})"
    )
    pairs.add_argument(
        "--oos-label",
        help="the data set's label of out-of-scope queries; not with --model, whose own "
        f"answers label the pairs (default: {DEFAULT_OOS_LABEL})",
    )
    pairs.add_argument(
        "--model",
        help="label pairs by this model's answers instead of the data set's: same-answer when "
        "the model answers the query as it answered the cached text, which is what `hopline "
        "cache eval` counts; the cached side keeps only answers the model's cache policy "
        "would store (in scope, score >= min_score)",
    )
    _model_args(pairs, "with --model; ")
    pairs.add_argument(
        "--min-score",
        # Outside 0-1 every answer, or none, would be stored.
        type=share(what=" (a score)"),
        default=None,
        help="with --model: store only answers scoring at least this, 0 to 1 (default: the "
        "policy's)",
    )
    pairs.add_argument("--out", type=Path, required=True)
    pairs.add_argument("--work-dir", type=Path, default=Path(work_dir), help=_WORK_DIR_HELP)
    pairs.set_defaults(cache_handler=_pairs)

    cal = cache_sub.add_parser(
        "calibrate", help="the similarity threshold that meets a target false-hit rate"
    )
    cal.add_argument("--pairs", type=Path, required=True, help="from `hopline cache pairs`")
    cal.add_argument("--target-false-hit-rate", type=share(zero=False, one=False), default=0.01)
    cal.add_argument(
        "--confidence",
        type=share(one=False),
        default=0.9,
        help="meet the target with this one-sided confidence (Wilson upper bound on the "
        "false-hit rate); 0 compares the measured rate itself",
    )
    cal.add_argument(
        "--min-hits",
        # 0 was read as "unset" (the default); a threshold resting on no hits means nothing.
        type=_whole(1),
        default=None,
        help="the evidence rule: the threshold needs this many hits (1 or more), and higher "
        "thresholds with fewer are too noisy to veto a lower one (default: 2 / target, two "
        "false hits' worth of evidence; less is allowed with a warning)",
    )
    cal.add_argument(
        "--folds",
        type=_whole(2),
        default=5,
        help="cross-validation folds (2 or more; at most one per pair: more are cut to the "
        "pairs' count, with a warning): the rule is run on all folds but one and its threshold "
        "measured on the one it did not see; the threshold is accepted only if that held-out "
        "false-hit rate meets the target",
    )
    cal.add_argument("--seed", type=int, default=0, help="the seed of the folds")
    cal.add_argument(
        "--check-pairs",
        type=Path,
        help="pairs the calibration never sees (another half of the data): the false-hit "
        "rate the chosen threshold gets on them is printed and written to --json",
    )
    cal.add_argument(
        "--png", type=Path, help="write the plot here (also when no threshold is accepted)"
    )
    cal.add_argument(
        "--json",
        type=Path,
        help="write the result, the cross-validation and the curve here (also when no "
        "threshold is accepted: then accepted is false, with the reason)",
    )
    cal.add_argument(
        "--reembed",
        action="store_true",
        help="recompute similarities with the bundled embedder (always done when absent)",
    )
    cal.add_argument("--work-dir", type=Path, default=Path(work_dir), help=_WORK_DIR_HELP)
    cal.set_defaults(cache_handler=_calibrate)

    ev = cache_sub.add_parser(
        "eval",
        help="warm the cache through a running gateway, then measure hit rate, cache-induced "
        "error and latency on labelled queries",
    )
    ev.add_argument("--clinc", type=Path, required=True, help="CLINC150 data_full.json")
    ev.add_argument("--model", required=True, help="a model trained on the same intents")
    _model_args(ev, "")
    ev.add_argument("--gateway", help="gateway address [env HOPLINE_GATEWAY_ADDR]")
    ev.add_argument("--cache", help="cache service address, for its stats [env HOPLINE_CACHE_ADDR]")
    ev.add_argument(
        "--max-intents",
        type=_whole(0),
        default=0,
        help="only the first N intents (0: all), for CI",
    )
    ev.add_argument(
        "--concurrency",
        type=_whole(1),
        default=2,
        help="warm-up requests in flight, 1 or more (more than the cores makes lookups overrun "
        "their budget and fail open, which leaves the cache half warm)",
    )
    ev.add_argument(
        "--exact-repeats",
        type=_whole(0),
        default=500,
        help="afterwards, resend this many stored misses (0 or more) to time exact hits (not "
        "counted in the hit rate)",
    )
    ev.add_argument(
        "--verified-model",
        default="",
        help="also run the verified mode in the same run: this model (the same weights as "
        "--model: the same labels, out-of-scope threshold and files, else refused; its cache "
        "policy with a verify_target) gets the same warm-up and queries under its own tenant",
    )
    ev.add_argument(
        "--seed", type=int, default=0, help="the shuffle of the warm-up and the queries"
    )
    ev.add_argument("--out", type=Path, help="directory for cache-eval.json and cache-eval.md")
    ev.set_defaults(cache_handler=_eval)

    user = cache_sub.add_parser(
        "milvus-user",
        help="make the cache's own Milvus user (HOPLINE_CACHE_MILVUS_TOKEN_FILE's "
        "user:password) with only the privileges the cache needs, on the Milvus server the "
        "cache's settings name; run once, with an administrator's token",
    )
    user.add_argument(
        "--admin-token-file",
        type=Path,
        required=True,
        help="a file holding an administrator's user:password (root's, at first)",
    )
    user.set_defaults(cache_handler=_milvus_user)
    add_invalidate(cache_sub)
    add_stats(cache_sub)


def _milvus_user(args: argparse.Namespace) -> int:
    from hopline.cache.config import CacheConfig
    from hopline.cache.milvus_access import MilvusAccess
    from hopline.cache.milvus_user import admin_client, ensure_cache_user
    from hopline.cache.store import CacheSettingError, CacheStoreError
    from hopline.runtime import config as cfg

    config = cfg.load(CacheConfig, [], prog="hopline cache milvus-user")
    admin_token = args.admin_token_file.read_text().strip()  # unreadable: said by the caller
    try:
        access = MilvusAccess.of(config)  # the cache's settings, its token file read
        client = admin_client(config, access, admin_token)
        try:
            done = ensure_cache_user(client, access.token, access.db_name)
        finally:
            client.close()
    except CacheStoreError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2 if isinstance(exc, CacheSettingError) else 1  # a typo, not an outage
    except Exception as exc:  # pymilvus's many kinds: a refused token, a missing privilege
        sys.stderr.write(f"error: Milvus at {config.uri} refused: {exc}\n")
        return 1
    sys.stdout.write("".join(f"{line}\n" for line in done))
    return 0


def _model_args(parser: argparse.ArgumentParser, prefix: str) -> None:
    """--model-version and --model-repo, shared by the commands that load a model."""
    parser.add_argument("--model-version", default="", help=f"{prefix}default: the latest")
    parser.add_argument(
        "--model-repo",
        type=Path,
        default=Path(os.environ.get("HOPLINE_MODEL_REPO", "models")),
        help=f"{prefix}the model repository [env HOPLINE_MODEL_REPO]",
    )


def _eval(args: argparse.Namespace) -> int:
    from hopline.cache.evaluate import run
    from hopline.cache.evaluation_report import markdown
    from hopline.gateway.client import gateway_address
    from hopline.model.repository import ModelRepository
    from hopline.runtime.ports import dial_problem
    from hopline.runtime.service_table import spec

    if args.out is not None:
        _check_out(args.out, "--out", directory=True)
    cache_address = args.cache if args.cache is not None else spec("cache").address()
    # As `cache stats` and `cache invalidate` check theirs: left to gRPC, a port past 65535
    # dialled another server, whose answers the evaluation then counted (a helper's read).
    for address, named_by in (
        (
            gateway_address(args.gateway),
            "--gateway" if args.gateway is not None else "HOPLINE_GATEWAY_ADDR",
        ),
        (cache_address, "--cache" if args.cache is not None else "HOPLINE_CACHE_ADDR"),
    ):
        if problem := dial_problem(address, named_by):
            raise UsageError(problem)
    resolved = ModelRepository(args.model_repo).resolve(args.model, args.model_version)
    policy = resolved.cache
    if policy.mode != "semantic":
        sys.stderr.write(
            f"note: {args.model}'s cache mode is {policy.mode!r}: only the exact tier answers\n"
        )
    verified = None
    if args.verified_model:
        verified_config = ModelRepository(args.model_repo).resolve(args.verified_model, "")
        # The verified pass reuses the static pass's answers as the model's own: figures
        # from other weights would be measured against answers that model never gives.
        differs = weights_difference(resolved, verified_config)
        if differs is not None:
            raise UsageError(
                f"--verified-model {verified_config.key} is not the weights of --model "
                f"{resolved.key}: {differs}; copy that version under the verified name "
                "(docs/cache.md, Measuring it)"
            )
        verified = verified_config.cache
        if verified.verify_target <= 0:
            raise ValueError(
                f"{args.verified_model}'s cache policy has no verify_target: set one in its "
                "config.json (docs/cache.md, Verified hits)"
            )
    try:
        report = run(
            args.clinc,
            gateway=gateway_address(args.gateway),
            cache=cache_address,
            model=args.model,
            model_version=resolved.version,
            policy=policy,
            max_intents=args.max_intents,
            concurrency=args.concurrency,
            exact_repeats=args.exact_repeats,
            verified_model=args.verified_model,
            verified_policy=verified,
            seed=args.seed,
            out_dir=args.out,
            labels=resolved.labels,
        )
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ValueError(
                "cache eval runs each pass as a tenant of its own (eval-<time>), so that every "
                "pass starts from an empty cache; a gateway with API keys fixes each caller's "
                "tenant: evaluate on a mesh started without HOPLINE_API_KEYS"
            ) from err
        raise
    sys.stdout.write(markdown(report))
    if args.out:
        sys.stdout.write(f"\nwrote {args.out / 'cache-eval.json'} and cache-eval.md\n")
    return 0


def weights_difference(model: ModelConfig, other: ModelConfig) -> str | None:
    """What would make `other` answer a text otherwise than `model`, or None: its labels,
    its out-of-scope threshold, or the contents of any file its config names (the cache
    policy, in config.json, may differ: that is what a verified copy changes)."""
    if other.labels != model.labels:
        return "its labels differ"
    if other.oos_threshold != model.oos_threshold:
        return f"its oos_threshold is {other.oos_threshold:g}, not {model.oos_threshold:g}"
    for role in sorted(set(model.files) | set(other.files)):
        if role == "labels":
            continue  # compared above, as labels: the same list in other JSON is the same
        if role not in model.files or role not in other.files:
            return f"only one of them has a {role} file"
        if not filecmp.cmp(model.file(role), other.file(role), shallow=False):
            return f"its {role} file ({other.files[role]}) differs"
    return None


def run_cache_command(args: argparse.Namespace) -> int:
    from hopline.cache.store import EncoderBuildError
    from hopline.model.repository import ModelNotFoundError
    from hopline.observability.logs import LogFormat, setup_logging

    setup_logging(f"cache-{args.cache_command}", fmt=LogFormat.TEXT)
    handler: Any = args.cache_handler
    try:
        return int(handler(args))
    except ModelNotFoundError as exc:  # a misspelt --model or --model-version: a usage error
        sys.stderr.write(
            f"hopline cache {args.cache_command}: error: {exc} in --model-repo {args.model_repo}\n"
        )
        return 2
    except UsageError as exc:  # before ValueError: a flag's mistake, said as argparse says one
        sys.stderr.write(f"hopline cache {args.cache_command}: error: {exc}\n")
        return 2
    except BrokenPipeError:  # our reader is gone, not a file's error: hopline's main ends quietly
        raise
    except (ValueError, OSError, EncoderBuildError) as exc:
        # Data and file errors are the user's to fix: one line, no traceback (an encoder that
        # cannot be built in --work-dir ended in one: an operator's probe).
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except grpc.RpcError as err:  # a service down or refusing: which, and what it said
        sys.stderr.write(f"error: {err.code().name}: {err.details()}\n")
        return 1


def _embedder(work_dir: Path) -> Embedder:
    from hopline.cache.embedder import Embedder
    from hopline.model.build import default_weights_dir

    return Embedder.load(default_weights_dir(), work_dir)


def _holdout(examples: Examples, share: float, seed: int) -> tuple[Examples, Examples]:
    """Per label, `share` of the examples become queries and the rest the store."""
    by_label: dict[str, Examples] = defaultdict(list)
    for example in examples:
        by_label[example[1]].append(example)
    rng = random.Random(seed)
    store: Examples = []
    queries: Examples = []
    for label in sorted(by_label):
        group = by_label[label]
        rng.shuffle(group)
        n = round(len(group) * share)
        queries += group[:n]
        store += group[n:]
    return store, queries


def _splits(path: Path, names: Sequence[str]) -> Examples:
    expected = "one JSON object of splits of [text, label] (as CLINC150's data_full.json)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: neither names the file
        raise ValueError(
            f"--clinc {path}: expected {expected}: {exc}; JSON Lines of {{text,label}} go to "
            "--train"
        ) from exc
    if not isinstance(data, dict):
        raise ValueError(f"--clinc {path}: expected {expected}")
    out: Examples = []
    for name in names:
        if name not in data:
            raise ValueError(f"{path}: no split {name!r} (has {', '.join(sorted(data))})")
        for n, row in enumerate(data[name], 1):
            if not (
                isinstance(row, list) and len(row) == 2 and all(isinstance(x, str) for x in row)
            ):
                raise ValueError(f"{path}: {name}[{n}] is not [text, label]")
            out.append((row[0], row[1]))
    return out


def _check_out(path: Path, flag: str, *, directory: bool) -> None:
    """Refuse an output path that cannot be written before any work: `eval --out` and
    `pairs --out` were checked only after the whole run (27 minutes on the full data set),
    which then ended in 'File exists' with nothing written or printed (a helper's probe)."""
    if (problem := output_problem(path, flag, directory=directory)) is not None:
        raise UsageError(problem)


def _one_source_flags(args: argparse.Namespace) -> None:
    """Flags of the other source are refused: each was silently ignored (a --split with
    --clinc read the store and query splits all the same; --holdout and --seed with --clinc,
    whose file names its store and query splits, split nothing)."""
    if args.clinc:
        given = [
            f
            for f, v in (
                ("--split", args.split),
                ("--holdout", args.holdout),
                ("--seed", args.seed),
            )
            if v is not None
        ]
        other = "--train"
    else:
        given = [
            f
            for f, v in (("--store-split", args.store_split), ("--query-splits", args.query_splits))
            if v is not None
        ]
        other = "--clinc"
    if given:
        raise UsageError(f"{' and '.join(given)} go with {other}, not this source")


def _pairs(args: argparse.Namespace) -> int:
    from hopline.cache.pairs import derive_pairs, write_pairs
    from hopline.model.build import load_examples

    _one_source_flags(args)
    if args.min_score is not None and not args.model:
        raise UsageError("--min-score goes with --model (the answers whose scores it reads)")
    if args.model_version and not args.model:
        raise UsageError("--model-version goes with --model (the model whose version it names)")
    if args.oos_label is not None and args.model:
        # The model's answers label the pairs: an out-of-scope answer is one like any other.
        raise UsageError(
            "--oos-label is the data set's label: not with --model, whose answers label the pairs"
        )
    _check_out(args.out, "--out", directory=False)
    if args.clinc:
        store = _splits(args.clinc, [args.store_split or "train"])
        queries = _splits(args.clinc, args.query_splits or ["val", "oos_val"])
    else:
        store, queries = _holdout(
            load_examples(args.train, args.split),
            DEFAULT_HOLDOUT if args.holdout is None else args.holdout,
            DEFAULT_SEED if args.seed is None else args.seed,
        )
    started = time.perf_counter()
    oos_label = DEFAULT_OOS_LABEL if args.oos_label is None else args.oos_label
    if args.model:
        store, queries = _model_labels(args, store, queries)
        oos_label = ""  # an out-of-scope answer is an answer like any other here
    pairs = derive_pairs(_embedder(args.work_dir).embed_many, store, queries, oos_label)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_pairs(pairs, args.out)
    same = sum(p.same for p in pairs)
    sys.stdout.write(
        f"wrote {args.out}  pairs={len(pairs)} same={same} different={len(pairs) - same} "
        f"store={len(store)} queries={len(queries)} "
        f"exact_repeats_skipped={len(queries) - len(pairs)} "
        f"({time.perf_counter() - started:.1f} s)\n"
    )
    return 0


def _model_labels(
    args: argparse.Namespace, store: Examples, queries: Examples
) -> tuple[Examples, Examples]:
    """The data set relabelled with the model's answers; the store as the policy fills it."""
    from hopline.services.pipeline import Pipeline

    pipeline = Pipeline.load(args.model_repo, args.model, args.model_version)
    policy = pipeline.config.cache
    min_score = policy.min_score if args.min_score is None else args.min_score
    stored = pipeline.predict_many([t for t, _ in store])
    kept = [
        (text, p.label)
        for (text, _), p in zip(store, stored, strict=True)
        if (policy.store_out_of_scope or not p.out_of_scope) and p.score >= min_score
    ]
    if not kept:
        raise ValueError(f"the policy of {pipeline.config.key} would store none of the texts")
    answered = pipeline.predict_many([t for t, _ in queries])
    sys.stdout.write(
        f"labelled by {pipeline.config.key}: {len(kept)} of {len(store)} store texts kept "
        f"(the answers its cache policy stores: score >= {min_score:g}"
        f"{', out of scope too' if policy.store_out_of_scope else ', in scope'})\n"
    )
    return kept, [(text, p.label) for (text, _), p in zip(queries, answered, strict=True)]


def _calibrate(args: argparse.Namespace) -> int:
    import numpy as np

    from hopline.cache.calibrate import default_min_hits, upper_bound
    from hopline.cache.calibration_report import (
        config_threshold,
        digits_of,
        floor_text,
        plot,
        to_json,
    )
    from hopline.cache.checked_calibration import calibrate_checked

    target = args.target_false_hit_rate
    for path, flag in ((args.png, "--png"), (args.json, "--json")):
        if path is not None:
            _check_out(path, flag, directory=False)
    pairs = _read_pairs(args.pairs)
    # Read now: a --check-pairs that is missing or no pairs file was said only after the
    # calibration, its embedding minutes on the full data set (a helper's probe).
    check_pairs = None
    if args.check_pairs is not None:
        if not args.check_pairs.is_file():
            raise UsageError(f"--check-pairs {args.check_pairs}: no such file")
        check_pairs = _read_pairs(args.check_pairs)
    folds = args.folds
    if folds > max(2, len(pairs)):
        # A fold per pair at most: more folds would be empty, and print as refusals.
        folds = max(2, len(pairs))
        sys.stderr.write(
            f"warning: --folds {args.folds} is more than the {len(pairs)} pairs: "
            f"{folds} folds, of one pair each\n"
        )
    sims = _similarities(args, pairs)
    min_hits = default_min_hits(target) if args.min_hits is None else args.min_hits
    report = calibrate_checked(
        sims, [p.same for p in pairs], target, min_hits, args.confidence, folds, args.seed
    )
    check = (
        _check(args, check_pairs, report.candidate.threshold)
        if check_pairs is not None and report.candidate is not None
        else None
    )
    # The files first: a refusal still leaves the curve and the reason on disk.
    written: list[str] = []
    if args.png:
        plot(report, args.png)
        written.append(f"plot  {args.png}")
    if args.json:
        doc = to_json(report)
        if check is not None:
            doc["check"] = check
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        written.append(f"json  {args.json}")
    for warning in report.warnings:
        sys.stderr.write(f"warning: {warning}\n")
    cv = report.cross_validation
    if not report.accepted:
        lines = [f"error: {report.reason}"]
        if cv is not None:
            lines.append(_held_out_row(cv))
        if check is not None:
            lines.append(_check_row(check))
        sys.stderr.write("\n".join(lines + written) + "\n")
        return 3
    result = report.candidate
    assert result is not None
    assert cv is not None
    text = config_threshold(result.threshold, result.next_lower)
    digits = digits_of(text)
    rows = [
        f"target false-hit rate  {result.target:g}",
        f"threshold              {text}",
        f"false-hit rate         {result.false_hit_rate:.4f}"
        + (
            f"  (upper bound {result.false_hit_bound:.4f} at {result.confidence:.0%} confidence)"
            if result.confidence > 0
            else ""
        ),
        _held_out_row(cv),
        *([_check_row(check)] if check is not None else []),
        f"precision              {result.precision:.4f}",
        f"recall                 {result.recall:.4f}",
        f"hit rate               {result.hit_rate:.4f}",
        f"hits / false / pairs   {result.hits} / {result.false_hits} / {result.pairs}"
        f"  ({result.same_pairs} same-answer)",
        f"min hits               {min_hits}"
        + (
            f"  (below the evidence rule's {default_min_hits(target)})"
            if min_hits < default_min_hits(target)
            else ""
        ),
        "",
        f"  {'threshold':>{digits + 2}}  false-hit  precision  recall  hit rate   hits",
    ]
    for offset in (0.10, 0.05, 0.02, 0.0, -0.02, -0.05, -0.10):
        p = result.curve.at(result.threshold + offset)
        if p.hits == 0:
            continue
        mark = "  <- chosen" if offset == 0.0 else ""
        shown = text if offset == 0.0 else floor_text(p.threshold, digits)
        rows.append(
            f"  {shown:>{digits + 2}}  {p.false_hit_rate:9.4f}  {p.precision:9.4f}  "
            f"{p.recall:6.4f}  {p.hit_rate:8.4f}  {p.hits:5d}{mark}"
        )
    if result.next_lower is not None:
        # Why not lower: the next observed similarity is the first to miss the rule.
        p = result.curve.at(result.next_lower)
        bound = ""
        if result.confidence > 0:
            ub = upper_bound(np.array([p.false_hits]), np.array([p.hits]), result.confidence)
            bound = f", upper bound {ub[0]:.4f}"
        rows.append(
            f"  next lower similarity {floor_text(p.threshold, digits)} has false-hit rate "
            f"{p.false_hit_rate:.4f} ({p.false_hits}/{p.hits}{bound})"
        )
    sys.stdout.write("\n".join(rows + written) + "\n")
    return 0


def _check(args: argparse.Namespace, pairs: Sequence[Pair], threshold: float) -> dict[str, Any]:
    """The threshold measured on --check-pairs, embedded as the calibration pairs were."""
    import numpy as np

    sims = _similarities(args, pairs)
    hit = sims >= threshold
    wrong = hit & ~np.array([p.same for p in pairs], dtype=bool)
    hits = int(hit.sum())
    return {
        "pairs_file": str(args.check_pairs),
        "threshold": threshold,
        "pairs": len(pairs),
        "hits": hits,
        "false_hits": int(wrong.sum()),
        "false_hit_rate": round(int(wrong.sum()) / hits, 4) if hits else 0.0,
        "hit_rate": round(hits / len(pairs), 4),
    }


def _read_pairs(path: Path) -> list[Pair]:
    """A pairs file's distinct pairs; PairsFileError naming the line of a similarity that is
    not a cosine."""
    from hopline.cache.pairs import PairsFileError, read_pairs

    pairs = read_pairs(path)
    for index, pair in enumerate(pairs):
        sim = pair.similarity
        if sim is not None and not -1.0 - _COSINE_SLACK <= sim <= 1.0 + _COSINE_SLACK:
            raise PairsFileError(
                f"{path}:{_line_of(path, index)}: similarity {sim:g} is not a cosine "
                "(-1 to 1); drop the similarities to recompute them, or use --reembed"
            )
    # The same pair twice (a query split named twice, files concatenated) is one piece of
    # evidence counted twice: it skews the curve, and the folds would hold it on both sides.
    distinct = list(dict.fromkeys(pairs))
    if len(distinct) < len(pairs):
        sys.stderr.write(
            f"note: {path}: {len(pairs) - len(distinct)} repeated pairs (the same query, "
            "candidate, labels and similarity) counted once\n"
        )
    return distinct


def _line_of(path: Path, index: int) -> int:
    """The line of the `index`th pair: read_pairs reads one per non-blank line."""
    with path.open(encoding="utf-8") as f:
        rows = (n for n, line in enumerate(f, 1) if line.strip())
        return next(n for i, n in enumerate(rows) if i == index)


def _similarities(args: argparse.Namespace, pairs: Sequence[Pair]) -> Any:
    """The pairs' cosines: the file's, or recomputed (--reembed, or any missing)."""
    import numpy as np

    from hopline.cache.pairs import pair_similarities

    if args.reembed or any(p.similarity is None for p in pairs):
        sims = pair_similarities(_embedder(args.work_dir).embed_many, pairs)
    else:
        sims = np.array([p.similarity for p in pairs], dtype=np.float64)
    # Rounding's overshoot past 1 cut back: a threshold above 1 is one no version can hold.
    return np.clip(sims, -1.0, 1.0)


def _check_row(check: dict[str, Any]) -> str:
    return (
        f"check pairs false-hit  {check['false_hit_rate']:.4f}  ({check['false_hits']} of "
        f"{check['hits']} hits wrong on {check['pairs']} pairs never used to calibrate, hit "
        f"rate {check['hit_rate']:.4f})"
    )


def _held_out_row(cv: CrossValidation) -> str:
    per_fold = " ".join(
        "none" if f.threshold is None else f"{f.false_hit_rate:.4f}" for f in cv.folds
    )
    return (
        f"held-out false-hit rate {cv.false_hit_rate:.4f}  ({cv.false_hits} of {cv.hits} hits "
        f"wrong on pairs the rule did not see, hit rate {cv.hit_rate:.4f}; {len(cv.folds)} "
        f"folds, seed {cv.seed}: {per_fold})"
    )
