"""argparse ``type=`` checkers for the error contract: a flag's nonsense value (0 devices, a
negative backoff, NaN tolerance, a float token dtype) is refused while parsing, as one line naming
the flag (``argument --devices: must be a positive integer, got -4``), exit status 2, and
``{"error": ...}`` with ``--json``."""

from __future__ import annotations

import argparse
import math

TOKEN_DTYPES = ("uint8", "uint16", "uint32", "uint64")


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def _float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
    return v


def positive_int(s: str) -> int:
    v = _int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def nonneg_int(s: str) -> int:
    v = _int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def positive_float(s: str) -> float:
    v = _float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s!r}")
    return v


def nonneg_float(s: str) -> float:
    v = _float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s!r}")
    return v


def fraction(s: str) -> float:
    """A number in [0, 1)."""
    v = _float(s)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {s!r}")
    return v


def int_in(lo: int, hi: int):
    """An integer in lo..hi (inclusive): for flags whose huge values would overflow a seed or an index."""
    def check(s: str) -> int:
        v = _int(s)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi}, got {v}")
        return v
    return check


# A seed flag: the range of ``train.seed`` (numpy's generators refuse negatives with a message
# that names nothing).
seed = int_in(0, 2**63 - 1)
