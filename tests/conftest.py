"""Test-wide settings and fixtures (helpers live in trainlib.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Tests run on the CPU, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile for TPU slices ahead of time (libtpu, no chip), in `make test`'s two workers at once
# and beside other test runs; libtpu's one-process lockfile would refuse all but the first. Only on
# the CPU: on a chip that lock keeps a second process off the TPU.
if os.environ["JAX_PLATFORMS"].split(",")[0].strip() == "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

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


# --------------------------------------------------------------------------- platforms
# One place decides which tests run where. ``tpu`` tests (tests/test_tpu.py, `make test-tpu`) make
# claims about a TPU and skip unless JAX_PLATFORMS names one (where it does, a backend that is not a
# TPU fails them); ``cpu_only`` tests (olmax's C++ CPU kernels, the CPU's decode layouts) mean
# nothing elsewhere and skip where JAX's backend is not the CPU. ``tpu_subprocess`` tests start olmax
# processes that open the chip, which admits one process: on a chip they run in a pytest invocation
# of their own (make test-tpu's second), whose process must start no JAX backend; a session running
# nothing else checks that around each of them, on the CPU too. OLMAX_TPU_TESTS_ON_CPU=1 rehearses
# the tpu tests on the CPU (splash in Pallas interpret mode).
TPU_ON_CPU = os.environ.get("OLMAX_TPU_TESTS_ON_CPU") == "1"
_SPAWN_ONLY: list[bool] = []  # set at collection: the session runs tpu_subprocess tests alone


def _platforms() -> list[str]:
    return [p.strip() for p in os.environ["JAX_PLATFORMS"].split(",") if p.strip()]


def _chip_session() -> bool:
    return "tpu" in _platforms() and not TPU_ON_CPU


def _backend() -> str:
    """JAX's default backend: read from JAX_PLATFORMS where it names the CPU first (nothing is
    started), else asked of JAX (which starts its backends in this process)."""
    if _platforms()[:1] == ["cpu"]:
        return "cpu"
    import jax
    return jax.default_backend()


def _backend_started() -> bool:
    xb = sys.modules.get("jax._src.xla_bridge")
    return xb is not None and xb.backends_are_initialized()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spawn = [i for i in items if i.get_closest_marker("tpu_subprocess")]
    _SPAWN_ONLY[:] = [bool(spawn) and len(spawn) == len(items)]
    if spawn and len(spawn) < len(items) and _chip_session():
        raise pytest.UsageError(
            "tpu_subprocess tests start processes that open the TPU, which admits one process: run them "
            "in a pytest invocation of their own (-m tpu_subprocess; make test-tpu does)")


def _check_spawning(item: pytest.Item, when: str) -> None:
    if item.get_closest_marker("tpu_subprocess") and (_chip_session() or any(_SPAWN_ONLY)) and _backend_started():
        pytest.fail(f"pytest's process has started JAX's backends ({when} {item.name}): on a chip it would hold "
                    "the TPU that the test's olmax processes need")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cpu_only") and _backend() != "cpu":
        pytest.skip(f"CPU only (olmax's CPU kernels or layouts); JAX's backend is {_backend()}")
    if not item.get_closest_marker("tpu") or TPU_ON_CPU:
        _check_spawning(item, "before")
        return
    if "tpu" not in _platforms():
        pytest.skip("needs a TPU (make test-tpu on a chip; OLMAX_TPU_TESTS_ON_CPU=1 rehearses it on the CPU)")
    _check_spawning(item, "before")
    if not item.get_closest_marker("tpu_subprocess") and _backend() != "tpu":
        pytest.fail(f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} names the TPU, yet JAX's backend is {_backend()}")


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _check_spawning(item, "after")
