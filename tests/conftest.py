"""Test-wide settings and fixtures (helpers live in trainlib.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests run on the CPU, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from trainlib import write_corpus  # noqa: E402


@pytest.fixture
def corpus(tmp_path: Path) -> list[str]:
    return write_corpus(tmp_path / "corpus")
