"""Platform kernels behind ``olmax.model.dispatch``, which decides where each one runs: ``cpu``
(olmax's C++ kernels for x86-64 CPUs, built on first use, and their ``jax.ffi`` calls). Imports
``olmax.sharding`` (to run a call per batch shard on a mesh), never the model."""
