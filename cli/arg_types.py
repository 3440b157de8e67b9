"""argparse types for the `hopline` command's numbers: a value that cannot work is argparse's
own error line (the flag named, exit 2) before anything starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above 0, else argparse's own error line."""

    def parse(raw: str) -> float:
        value = kind(raw)
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be above 0, got {raw}")
        if not math.isfinite(value):  # inf: a timeout of none, a bench that never ends
            raise argparse.ArgumentTypeError(f"must be a finite number, got {raw}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def at_least_zero(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {raw}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {raw}")
    return value


def finite(raw: str) -> float:
    """Any number but NaN and infinities: a NaN limit compares false with everything, so
    `--min-cosine nan` switched the precision check off and wrote NaN into config.json, and
    an infinite one checks nothing either (an operator's probe)."""
    value = float(raw)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {raw}")
    return value


finite.__name__ = "float"


def cosine(raw: str) -> float:
    """A cosine similarity's limit, -1 to 1: above 1 no embedding could pass (every converted
    build refused), and -1 already admits every one."""
    value = finite(raw)
    if not -1 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a cosine, from -1 to 1, got {raw}")
    return value


cosine.__name__ = "float"


# share()'s range in words, by whether 0 and 1 themselves are in it.
_SHARE_RANGES = {
    (True, True): "from 0 to 1",
    (True, False): "from 0 up to (not including) 1",
    (False, True): "above 0 and at most 1",
    (False, False): "above 0 and below 1",
}


def share(*, zero: bool = True, one: bool = True, what: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number from 0 to 1, `zero` and `one` saying whether the ends
    themselves are allowed (a rate, a share of texts, a score, a similarity threshold). Such
    ranges were checked once the command ran, and refused with exit 1, not as a flag."""
    said = _SHARE_RANGES[zero, one] + what

    def parse(raw: str) -> float:
        value = finite(raw)
        above = value >= 0 if zero else value > 0
        below = value <= 1 if one else value < 1
        if not (above and below):
            raise argparse.ArgumentTypeError(f"must be {said}, got {raw}")
        return value

    parse.__name__ = "float"
    return parse


def model_version(raw: str) -> str:
    """`model build --version`: a version folder's name (model/repository.py:is_version)."""
    from hopline.model.repository import is_version  # numpy: only when the flag is given

    if not is_version(raw):  # `01` would be built, never served
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, without leading zeros, got {raw!r}"
        )
    return raw


def providers(raw: str) -> str:
    """`model build --providers`: comma-separated execution providers each known by name; the
    string itself is kept (empty: the precision's defaults)."""
    from hopline.model.providers import ProviderConfigError, parse_providers

    try:
        parse_providers(raw.split(",") if raw else [])
    except ProviderConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return raw


# gRPC keeps a deadline in int64 nanoseconds: past about 9.2e9 s it wraps to the past, and
# `predict --timeout 1e10` was an immediate DEADLINE_EXCEEDED (an operator's probe).
MAX_TIMEOUT_S = 1e9


def timeout_s(raw: str) -> float:
    """A deadline in seconds: above 0, at most MAX_TIMEOUT_S."""
    value = positive(float)(raw)
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:g} s, got {raw}")
    return value


timeout_s.__name__ = "float"

INT32_MAX = 2**31 - 1


def top_k(raw: str) -> int:
    """`--top-k`: PredictRequest.top_k is an int32; the gateway checks it against the model's
    labels. 0 asks for the default (1), as an unset field does."""
    value = int(raw)
    if not 0 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be 0 to {INT32_MAX}, got {raw}")
    return value


top_k.__name__ = "int"


def utf8_text(raw: str) -> str:
    """A string argument that can be sent: bytes the locale could not decode reach Python as
    lone surrogates, which a protobuf string cannot hold."""
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError as exc:
        undecoded = exc.object[exc.start : exc.end].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(
            f"is not valid UTF-8 ({undecoded!r} at character {exc.start}): hopline sends "
            "text as UTF-8"
        ) from None
    return raw
