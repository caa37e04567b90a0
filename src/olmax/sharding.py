"""Device mesh, logical-axis rules and global batch arithmetic.

The model declares logical axes per parameter (``olmax.model.params``); ``RULES`` is the one
place that maps them onto the mesh axes ``data``, ``fsdp`` and ``tensor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from olmax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both data-parallel axes

# logical axis -> mesh axis (or None = replicated). FSDP shards the d_model ("embed") dimension
# of every matrix; tensor parallelism splits heads, MLP hidden and vocabulary.
RULES: dict[str, str | None] = {
    "embed": "fsdp",
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 entries against the *global* device count and check the product."""
    sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"at most one mesh axis may be -1, got {', '.join('mesh.' + k for k in free)}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if any(v == 0 or v < -1 for v in sizes.values()):
        raise ConfigError(f"mesh sizes must be positive or -1, got {sizes}")
    if free:
        if n_devices % fixed:
            raise ConfigError(f"{n_devices} devices cannot be split by the fixed mesh axes {sizes} (product {fixed})")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"mesh {sizes} has {math.prod(sizes.values())} devices but {n_devices} are available; "
                          "set one of mesh.data/mesh.fsdp/mesh.tensor to -1")
    return sizes


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())  # global, never jax.local_devices()
    sizes = mesh_shape(cfg, len(devices))
    arr = np.asarray(devices).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(arr, MESH_AXES)


def logical_to_spec(axes: tuple[str, ...], mesh: Mesh | None = None) -> P:
    out = []
    used = set()
    for a in axes:
        m = RULES.get(a)
        # A mesh axis may appear once per array, and size-1 axes are pointless to name.
        if m is None or m in used or (mesh is not None and mesh.shape[m] == 1):
            out.append(None)
        else:
            out.append(m)
            used.add(m)
    return P(*out)


def param_shardings(logical: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh)), logical,
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int          # instances per optimizer step (fixed by the recipe)
    n_devices: int             # global device count
    data_parallel: int         # devices the batch is split over (data * fsdp)
    per_device: int            # instances per data-parallel shard per step
    micro_batch: int           # instances per shard per micro-batch
    accum_steps: int           # micro-batches per step


def plan_batch(global_batch: int, mesh_sizes: dict[str, int], micro_batch: int | None) -> BatchPlan:
    """Per-device batch from the *global* device count. The published reproduction's elastic
    pitfall: deriving it from local devices silently changes the effective batch."""
    dp = mesh_sizes["data"] * mesh_sizes["fsdp"]
    n = math.prod(mesh_sizes.values())
    if global_batch % dp:
        raise ConfigError(f"train.global_batch_size={global_batch} is not divisible by the {dp} data-parallel "
                          f"shards (mesh data={mesh_sizes['data']} x fsdp={mesh_sizes['fsdp']} on {n} devices)")
    per = global_batch // dp
    mb = micro_batch or per
    if per % mb:
        raise ConfigError(f"train.micro_batch_size={mb} does not divide the per-device batch {per} "
                          f"(train.global_batch_size={global_batch} over {dp} data-parallel shards)")
    return BatchPlan(global_batch, n, dp, per, mb, per // mb)
