"""Fixtures for the data tests (helpers live in data_testlib.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_testlib import make_cfg, random_files

from olmax.config import Config


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    return random_files(tmp_path / "tokens")


@pytest.fixture
def cfg(files: list[str], tmp_path: Path) -> Config:
    return make_cfg(files, tmp_path / "cache")
