"""olmax: faithful, verified reproductions of published LLM pre-training runs in JAX.

Layers, lowest first; a module imports from its own layer or below (tests/test_layers.py):
config, io, recipes | model, sharding, optim, data, metrics | train, eval, compat |
verify, compile, launch, demo | cli, commands and every ``*.commands`` module."""

import glob as _glob
import importlib.util as _ilu
import os as _os

__version__ = "0.1.0"


_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")


def _tpu_present() -> bool:
    return bool(_glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"))


def _stay_off_absent_tpus() -> None:
    """With the libtpu wheel installed (``olmax[tpu]``, for ahead-of-time compiles), every JAX
    start on a machine without a TPU probes for a chip and prints alarming warnings. Where no TPU
    device node exists and the user chose no platform, keep JAX on the CPU (or on the GPU when a
    CUDA plugin is installed). Runs on import, before JAX initialises a backend."""
    if "JAX_PLATFORMS" in _os.environ or "TPU_ACCELERATOR_TYPE" in _os.environ:
        return
    if _ilu.find_spec("libtpu") is None or _tpu_present():
        return
    if any(_ilu.find_spec(p) is not None for p in _GPU_PLUGINS):
        return  # a GPU machine: leave the choice to JAX
    _os.environ["JAX_PLATFORMS"] = "cpu"


def _cpu_only() -> bool:
    """Whether JAX will compute on the CPU: chosen so, or no accelerator to choose."""
    if "JAX_PLATFORMS" in _os.environ:
        return _os.environ["JAX_PLATFORMS"].split(",")[0].strip() == "cpu"
    tpu = _ilu.find_spec("libtpu") is not None and _tpu_present()
    return not tpu and not any(_ilu.find_spec(p) is not None for p in _GPU_PLUGINS)


def _keep_freed_memory() -> None:
    """glibc hands every freed block of 32 MiB or more, and the freed tops of worker threads'
    arenas, back to the kernel; the buffers of the next jitted step are then mapped afresh and
    every page is faulted in again (a fifth of the train step's time, in the kernel, on a 2-core
    CPU). One arena that keeps what it frees lets each step reuse the last step's memory. Only
    where JAX computes on the CPU; ``OLMAX_MALLOC=system`` leaves glibc as it is. Runs before
    JAX starts its threads: a thread keeps the arena it first allocated from."""
    if _os.environ.get("OLMAX_MALLOC", "").lower() == "system" or not _cpu_only():
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: the parameter numbers below are glibc's
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
    # one arena, no mmap'd blocks, never trim (-1), grow the heap 64 MiB at a time
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 64 << 20)):
        libc.mallopt(param, value)


_stay_off_absent_tpus()
_keep_freed_memory()
