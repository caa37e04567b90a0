"""Strict JSON for every ``--json`` printer and report file: a non-finite number (NaN, +-inf) is
written as ``null``, never as the ``NaN`` / ``Infinity`` tokens that Python's ``json`` emits by
default and that strict parsers (JavaScript's ``JSON.parse``, ``jq``, Go, Rust's serde) reject.
NumPy and JAX scalars and arrays become plain numbers and lists."""

from __future__ import annotations

import json
import math
from typing import Any


def strict(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by None, tuples as lists, NumPy/JAX values as Python ones."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    tolist = getattr(obj, "tolist", None)  # numpy / jax scalars and arrays
    if callable(tolist) and hasattr(obj, "dtype"):
        return strict(tolist())
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes NaN or Infinity (they become null); raises on anything
    else JSON cannot hold unless ``default`` is given."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)
