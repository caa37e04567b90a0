"""Load parameters from any olmax source, for evaluation, conversion and warm starts.

Accepted paths: an olmax weights directory (``config.yaml`` + safetensors, written by
``olmax convert``), a run directory (its newest checkpoint), or one checkpoint directory
``RUN/checkpoints/N``. An ``hf:DIR`` prefix reads an HF Olmo3 checkpoint.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import jax

from olmax.config import CheckpointConfig, Config, ConfigError, MeshConfig


def resolve_checkpoint(path: str | Path) -> tuple[Path, int]:
    """(run directory, step) for a run directory or a ``checkpoints/N`` directory."""
    from olmax.train.checkpoint import CHECKPOINT_DIR, Checkpointer
    p = Path(path)
    if p.parent.name == CHECKPOINT_DIR and p.name.isdigit():
        return p.parent.parent, int(p.name)
    if (p / CHECKPOINT_DIR).is_dir():
        ck = Checkpointer(p, CheckpointConfig(), read_only=True)
        step = ck.latest_step()
        ck.close()
        if step is None:
            raise ConfigError(f"run directory {p} has no complete checkpoint")
        return p, step
    raise ConfigError(f"{p} is neither an olmax weights directory, a run directory nor a checkpoint directory")


def restore_train_state(path: str | Path, mesh: jax.sharding.Mesh | None = None) -> tuple[Any, Any, Config, dict]:
    """(params, opt_state, config, meta) of a training checkpoint, replicated or on ``mesh``."""
    from olmax.model.params import init_params, logical_axes
    from olmax.optim import init_opt_state
    from olmax.sharding import make_mesh, param_shardings
    from olmax.train.checkpoint import Checkpointer
    from olmax.train.loop import opt_state_shardings
    run, step = resolve_checkpoint(path)
    meta = Checkpointer.read_meta(run, step)
    cfg = Config.from_dict(__import__("yaml").safe_load(meta["config_yaml"]))
    mesh = mesh or make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    pshard = param_shardings(logical_axes(cfg.model), mesh)
    p_abs = jax.eval_shape(partial(init_params, cfg.model), jax.random.key(0))
    o_abs = jax.eval_shape(partial(init_opt_state, optim_cfg=cfg.optim), p_abs)
    oshard = opt_state_shardings(o_abs, pshard, mesh)
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    abstract = {"params": jax.tree.map(sds, p_abs, pshard), "opt_state": jax.tree.map(sds, o_abs, oshard)}
    ck = Checkpointer(run, cfg.checkpoint, read_only=True)
    try:
        state, meta = ck.restore(step, abstract)
    finally:
        ck.close()
    return state["params"], state["opt_state"], cfg, meta


def load_params(path: str | Path, dtype: str | None = None) -> tuple[Any, Config]:
    """(params, config) from an olmax weights dir, a run/checkpoint dir, or ``hf:DIR``."""
    s = str(path)
    if s.startswith("hf:"):
        from olmax.compat.hf import load_hf_params
        return load_hf_params(s[3:], dtype=dtype)
    p = Path(s)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if (p / "config.yaml").is_file() and any(p.glob("*.safetensors")):
        from olmax.model.weights_io import load_weights
        return load_weights(p, dtype=dtype)
    params, _, cfg, _ = restore_train_state(p)
    if dtype is not None:
        params = jax.tree.map(lambda a: a.astype(dtype), params)
    return params, cfg
