"""Multi-process initialisation (``jax.distributed``) from flags or the environment.

Order of precedence: explicit arguments, then ``OLMAX_COORDINATOR`` / ``OLMAX_NUM_PROCESSES`` /
``OLMAX_PROCESS_ID``, then Slurm (``SLURM_NTASKS``, ``SLURM_PROCID``, with the coordinator from
``OLMAX_COORDINATOR`` or the first host of ``SLURM_STEP_NODELIST`` resolved by JAX's own
cluster detection). With none of these, the run is single-process.
"""

from __future__ import annotations

import os

import jax

from olmax.config import ConfigError

_initialised = False


def _env_int(name: str) -> int:
    """An integer environment variable; anything else is an error that names it."""
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected an integer") from None


def initialise(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None) -> tuple[int, int]:
    """Initialise once; returns (process_index, process_count)."""
    global _initialised
    env = os.environ
    coordinator = coordinator or env.get("OLMAX_COORDINATOR")
    if num_processes is None and "OLMAX_NUM_PROCESSES" in env:
        num_processes = _env_int("OLMAX_NUM_PROCESSES")
        if num_processes < 1:
            raise ConfigError(f"OLMAX_NUM_PROCESSES={num_processes}: must be >= 1")
    if process_id is None and "OLMAX_PROCESS_ID" in env:
        process_id = _env_int("OLMAX_PROCESS_ID")
    slurm = "SLURM_NTASKS" in env and _env_int("SLURM_NTASKS") > 1
    if _initialised:
        return jax.process_index(), jax.process_count()
    if coordinator or (num_processes and num_processes > 1):
        if not (coordinator and num_processes and process_id is not None):
            raise ConfigError("multi-process runs need the coordinator address, the process count and this "
                              "process's id (--coordinator/--num-processes/--process-id or OLMAX_COORDINATOR/"
                              "OLMAX_NUM_PROCESSES/OLMAX_PROCESS_ID)")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"process id {process_id} is outside 0..{num_processes - 1}")
        # CPU collectives across processes go through gloo (harmless on accelerators). Do not
        # query the backend here: that would initialise JAX before jax.distributed.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = {}
        if local_device_count is not None:
            kwargs["local_device_ids"] = list(range(local_device_count))
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, **kwargs)
        _initialised = True
    elif slurm or env.get("OLMAX_DISTRIBUTED") == "auto":
        # JAX's cluster detection fills in the rest (Slurm variables; TPU VM / GKE metadata for
        # `olmax launch tpu`, which sets OLMAX_DISTRIBUTED=auto). gloo: CPU-only Slurm jobs.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        why = f"SLURM_NTASKS={env['SLURM_NTASKS']}" if slurm else "OLMAX_DISTRIBUTED=auto"
        try:
            jax.distributed.initialize()
        except ValueError as e:  # JAX found no cluster to join (e.g. no coordinator address)
            raise ConfigError(f"{why} asks for a multi-process run, but JAX's cluster detection failed: {e} "
                              "(outside a Slurm step or a TPU slice, unset it)") from None
        _initialised = True
    return jax.process_index(), jax.process_count()
