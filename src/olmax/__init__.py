"""olmax: faithful, verified reproductions of published LLM pre-training runs in JAX.

Layers, lowest first; a module imports from its own layer or below (tests/test_layers.py):
config, io, recipes | model, sharding, optim, data, metrics | compat, checkpoint | train, eval |
verify, compile, measure (a step timed on this machine: compile imports it), launch, demos | cli,
commands and every ``*.commands`` module. No package imports a package that imports it back
(train imports eval, so eval never imports train)."""

import glob as _glob
import importlib.util as _ilu
import os as _os

__version__ = "0.1.0"


def _accelerator_present() -> bool:
    """A TPU (the libtpu wheel and a TPU device node) or a GPU plugin for JAX."""
    tpu = _ilu.find_spec("libtpu") is not None and bool(_glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"))
    gpu = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")
    return tpu or any(_ilu.find_spec(p) is not None for p in gpu)


def _stay_off_absent_tpus() -> None:
    """With the libtpu wheel installed (``olmax[tpu]``, for ahead-of-time compiles), every JAX
    start on a machine without a TPU probes for a chip and prints alarming warnings. Where no
    accelerator is present and the user chose no platform, keep JAX on the CPU. Runs on import,
    before JAX initialises a backend."""
    if "JAX_PLATFORMS" in _os.environ or "TPU_ACCELERATOR_TYPE" in _os.environ:
        return
    if _ilu.find_spec("libtpu") is not None and not _accelerator_present():
        _os.environ["JAX_PLATFORMS"] = "cpu"


def keep_freed_memory() -> None:
    """glibc hands every freed block of 32 MiB or more, and the freed tops of worker threads'
    arenas, back to the kernel; the buffers of the next jitted step are then mapped afresh and
    every page is faulted in again (a sixth of a tiny train step's CPU time, in the kernel, on a
    2-core CPU). One arena that keeps what it frees lets each step reuse the last step's memory.
    One arena also slows XLA's multi-threaded compiles by about a fifth, so ``olmax train`` and
    ``olmax demo`` call this, not every import. Only where JAX computes on the CPU;
    ``OLMAX_MALLOC=system`` leaves glibc as it is. Call it before JAX's first computation starts
    its threads: a thread keeps the arena it first allocated from."""
    platforms = _os.environ.get("JAX_PLATFORMS")
    cpu = platforms.split(",")[0].strip() == "cpu" if platforms else not _accelerator_present()
    if _os.environ.get("OLMAX_MALLOC", "").lower() == "system" or not cpu:
        return
    import ctypes
    libc = ctypes.CDLL(None) if _os.name == "posix" else None
    if not hasattr(libc, "gnu_get_libc_version"):
        return  # the parameter numbers below are glibc's
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
    # one arena, no mmap'd blocks, never trim (-1), grow the heap 64 MiB at a time
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 64 << 20)):
        libc.mallopt(param, value)


_stay_off_absent_tpus()
