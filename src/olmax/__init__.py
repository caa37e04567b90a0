"""olmax: faithful, verified reproductions of published LLM pre-training runs in JAX.

Layers, lowest first; a module imports from its own layer or below (tests/test_layers.py):
config, io, recipes | model, sharding, optim, data, metrics | train, eval, compat |
verify, compile, launch, demo | cli, commands and every ``*.commands`` module."""

import glob as _glob
import importlib.util as _ilu
import os as _os

__version__ = "0.1.0"


def _stay_off_absent_tpus() -> None:
    """With the libtpu wheel installed (``olmax[tpu]``, for ahead-of-time compiles), every JAX
    start on a machine without a TPU probes for a chip and prints alarming warnings. Where no TPU
    device node exists and the user chose no platform, keep JAX on the CPU (or on the GPU when a
    CUDA plugin is installed). Runs on import, before JAX initialises a backend."""
    if "JAX_PLATFORMS" in _os.environ or "TPU_ACCELERATOR_TYPE" in _os.environ:
        return
    if _ilu.find_spec("libtpu") is None:
        return
    if _glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"):
        return  # a TPU VM
    if any(_ilu.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")):
        return  # a GPU machine: leave the choice to JAX
    _os.environ["JAX_PLATFORMS"] = "cpu"


_stay_off_absent_tpus()
