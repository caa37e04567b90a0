"""Device mesh, logical-axis rules and global batch arithmetic.

The model declares logical axes per parameter (``olmax.model.params``) and per activation
(``constrain`` calls in ``olmax.model.olmo3``); ``RULES`` and ``ACTIVATION_RULES`` are the one
place that maps them onto the mesh axes ``slice`` (data parallelism across TPU slices, over
DCN), ``data``, ``fsdp`` and ``tensor``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmax.config import ConfigError, MeshConfig

MESH_AXES = ("slice", "data", "fsdp", "tensor")
BATCH_AXES = ("slice", "data", "fsdp")  # the batch dimension is split over every data-parallel axis

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

# Activations: the batch over every data-parallel axis, heads / MLP hidden / vocabulary over
# ``tensor``; sequence and d_model replicated (no sequence parallelism yet).
ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    "head_dim": None,
    "cache_stack": None,  # the layer axis of a stacked KV cache (olmax.model.decode)
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 entries against the *global* device count and check the product."""
    sizes = {"slice": cfg.slice, "data": cfg.data, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
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
    cap = getattr(cfg, "fsdp_max", None)
    if cap is not None and cfg.fsdp == -1 and sizes["fsdp"] > cap:
        if cfg.tensor != 1:
            raise ConfigError(f"mesh.fsdp_max={cap} moves the devices beyond it to tensor parallelism: "
                              f"mesh.tensor must be 1, got {cfg.tensor}")
        if cap < 1 or sizes["fsdp"] % cap:
            raise ConfigError(f"mesh.fsdp_max={cap} must divide the {sizes['fsdp']} FSDP shards of {n_devices} devices")
        sizes["fsdp"], sizes["tensor"] = cap, sizes["fsdp"] // cap
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"mesh {sizes} has {math.prod(sizes.values())} devices but {n_devices} are available; "
                          "set one of mesh.data/mesh.fsdp/mesh.tensor to -1")
    return sizes


def data_parallel_size(sizes: dict[str, int] | Any) -> int:
    """Shards the batch is split over (the product of the data-parallel mesh axes)."""
    return math.prod(int(sizes.get(a, 1)) for a in BATCH_AXES)


def device_slices(devices: list) -> int | None:
    """How many TPU slices ``devices`` span (distinct ``slice_index``); None off TPU, where
    devices carry no slice."""
    if not devices or getattr(devices[0], "platform", None) != "tpu":
        return None
    return len({getattr(d, "slice_index", 0) for d in devices})


def slice_mesh_config(cfg: MeshConfig, devices: list) -> MeshConfig:
    """``cfg`` with its ``slice`` axis matching the slices the devices span: the one source of the
    slice count for ``olmax train`` and ``olmax compile --slices N`` alike. ``mesh.slice`` left at
    its default 1 takes the count from the devices' ``slice_index``; any other value must equal it
    (``olmax launch tpu --num-slices N`` passes ``mesh.slice=N``, so a launch whose hosts came up
    as fewer slices stops here instead of training a different program)."""
    n = device_slices(devices)
    if n is None:
        return cfg
    if cfg.slice == 1 and n > 1:
        cfg = replace(cfg, slice=n)
    resolved = mesh_shape(cfg, len(devices))["slice"]
    if resolved != n:
        spelled = f"mesh.slice={cfg.slice}" + (f" (resolved to {resolved})" if cfg.slice != resolved else "")
        raise ConfigError(f"{spelled} but the {len(devices)} devices span {n} slice(s) (their slice_index); "
                          "leave mesh.slice at 1 to take the count from the devices, or launch on "
                          f"{resolved} slices (olmax launch tpu --num-slices {resolved})")
    return cfg


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """The mesh over the *global* devices (never ``jax.local_devices()``). On TPUs the devices
    are laid out by ``mesh_utils`` so that inner axes follow the physical torus (and the
    ``slice`` axis runs over DCN between slices, its size from :func:`slice_mesh_config`);
    elsewhere a plain reshape."""
    devices = list(devices if devices is not None else jax.devices())
    cfg = slice_mesh_config(cfg, devices)
    sizes = mesh_shape(cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    arr = None
    if devices and devices[0].platform == "tpu":
        from jax.experimental import mesh_utils
        try:
            if sizes["slice"] > 1:
                arr = mesh_utils.create_hybrid_device_mesh((1, *shape[1:]), (sizes["slice"], 1, 1, 1), devices)
            else:
                arr = mesh_utils.create_device_mesh(shape, devices)
        except (AssertionError, NotImplementedError, ValueError):
            arr = None  # a shape mesh_utils cannot place physically: fall back to the plain order
    if arr is None:
        arr = np.asarray(devices).reshape(shape)
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


def activation_spec(axes: tuple[str, ...], mesh: Mesh) -> P:
    """PartitionSpec of an activation with logical ``axes`` (``ACTIVATION_RULES``); size-1 mesh
    axes are left out and a mesh axis is used at most once."""
    out, used = [], set()
    for a in axes:
        rule = ACTIVATION_RULES[a]
        names = (rule,) if isinstance(rule, str) else tuple(rule or ())
        names = tuple(n for n in names if n not in used and mesh.shape.get(n, 1) > 1)
        used.update(names)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*out)


_ACTIVATION_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("olmax_activation_mesh", default=None)


@contextlib.contextmanager
def activation_mesh(mesh: Mesh | None) -> Iterator[None]:
    """While tracing inside this context, ``constrain`` pins activations to ``mesh``."""
    token = _ACTIVATION_MESH.set(mesh)
    try:
        yield
    finally:
        _ACTIVATION_MESH.reset(token)


def current_mesh() -> Mesh | None:
    return _ACTIVATION_MESH.get()


def single_device() -> bool:
    """Whether the program is traced for one device: no ``activation_mesh``, or a mesh of one."""
    mesh = _ACTIVATION_MESH.get()
    return mesh is None or mesh.size == 1


def constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sharding constraint by logical activation axes; a no-op outside ``activation_mesh`` (one
    device, tests). Without these XLA may pick an FSDP layout that gathers activations."""
    if single_device():
        return x
    mesh = _ACTIVATION_MESH.get()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, activation_spec(axes, mesh)))


def param_shardings(logical: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh)), logical,
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)  # meshes built by hand may lack some
    return NamedSharding(mesh, P(axes, *([None] * (ndim - 1))))


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int          # instances per optimizer step (fixed by the recipe)
    n_devices: int             # global device count
    data_parallel: int         # devices the batch is split over (slice * data * fsdp)
    per_device: int            # instances per data-parallel shard per step
    micro_batch: int           # instances per shard per micro-batch
    accum_steps: int           # micro-batches per step


def plan_batch(global_batch: int, mesh_sizes: dict[str, int], micro_batch: int | None,
               max_micro_batch: int | None = None) -> BatchPlan:
    """Per-device batch from the *global* device count. The published reproduction's elastic
    pitfall: deriving it from local devices silently changes the effective batch.

    ``micro_batch`` must divide the per-device batch; ``max_micro_batch`` instead picks the largest
    divisor that is no larger."""
    dp = data_parallel_size(mesh_sizes)
    n = math.prod(mesh_sizes.values())
    if global_batch % dp:
        axes = " x ".join(f"{a}={mesh_sizes.get(a, 1)}" for a in BATCH_AXES)
        raise ConfigError(f"train.global_batch_size={global_batch} is not divisible by the {dp} data-parallel "
                          f"shards (mesh {axes} on {n} devices)")
    per = global_batch // dp
    mb = micro_batch or per
    if micro_batch is None and max_micro_batch is not None:
        mb = max(d for d in range(1, min(per, max_micro_batch) + 1) if per % d == 0)
    if per % mb:
        raise ConfigError(f"train.micro_batch_size={mb} does not divide the per-device batch {per} "
                          f"(train.global_batch_size={global_batch} over {dp} data-parallel shards)")
    return BatchPlan(global_batch, n, dp, per, mb, per // mb)


def split_micro(x: jax.Array, accum: int) -> jax.Array:
    """[B, ...] -> [accum, B/accum, ...] with micro-batch a = rows a::accum, so every micro-batch
    is spread evenly over the data-parallel shards (rows are sharded in contiguous blocks)."""
    b = x.shape[0]
    return x.reshape(b // accum, accum, *x.shape[1:]).swapaxes(0, 1)
