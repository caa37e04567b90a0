"""Test-wide settings and fixtures (helpers live in trainlib.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests run on the CPU, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compilation is most of the suite's time, and many tests (and the olmax processes they start, which
# inherit this environment) compile the same small programs. JAX's persistent cache keeps every
# compiled program, keyed by its HLO, flags and devices, so a repeat loads instead of compiling; the
# unit and integration tiers share it. OLMAX_TEST_JAX_CACHE=0 turns it off.
if os.environ.get("OLMAX_TEST_JAX_CACHE", "1") != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          str(Path(__file__).resolve().parents[1] / ".cache" / "jax-tests"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from trainlib import write_corpus  # noqa: E402


@pytest.fixture
def corpus(tmp_path: Path) -> list[str]:
    return write_corpus(tmp_path / "corpus")
