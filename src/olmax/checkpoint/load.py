"""Load parameters from any olmax source, for evaluation, conversion and warm starts.

Accepted paths: an olmax weights directory (``config.yaml`` + safetensors, written by
``olmax convert``), a run directory (its newest checkpoint), or one checkpoint directory
``RUN/checkpoints/N``. An ``hf:DIR`` prefix reads an HF Olmo3 checkpoint. Parameters alone are
read from a training checkpoint: Adam's moments (twice the parameters' size) stay on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from olmax import io
from olmax.checkpoint.state import abstract_train_state
from olmax.checkpoint.store import CHECKPOINT_DIR, Checkpointer, config_from_meta
from olmax.compat.hf import load_hf_params
from olmax.config import CheckpointConfig, Config, ConfigError, MeshConfig
from olmax.model.weights_io import is_weights_dir, load_weights
from olmax.sharding import make_mesh


def resolve_checkpoint(path: str | Path) -> tuple[Path | str, int]:
    """(run directory, step) for a run directory or a ``checkpoints/N`` directory."""
    if io.is_remote(path):  # s3:// or gs:// run directory, or RUN/checkpoints/N
        url = str(path).rstrip("/")
        head, _, last = url.rpartition("/")
        if last.isdigit() and head.endswith("/" + CHECKPOINT_DIR):
            return head[: -len(CHECKPOINT_DIR) - 1], int(last)  # type: ignore[return-value]
        return url, _latest_step(url, f"{url} holds no committed checkpoint (checkpoints/N/_OLMAX_COMMITTED)")
    p = Path(path)
    if p.parent.name == CHECKPOINT_DIR and p.name.isdigit():
        return p.parent.parent, int(p.name)
    if (p / CHECKPOINT_DIR).is_dir():
        return p, _latest_step(p, f"run directory {p} has no complete checkpoint")
    raise ConfigError(f"{p} is neither an olmax weights directory, a run directory nor a checkpoint directory")


def _latest_step(run: str | Path, none_msg: str) -> int:
    ck = Checkpointer(run, CheckpointConfig(), read_only=True)
    step = ck.latest_step()
    ck.close()
    if step is None:
        raise ConfigError(none_msg)
    return step


def restore_train_state(path: str | Path, mesh: jax.sharding.Mesh | None = None, *, params_only: bool = False
                        ) -> tuple[Any, Any, Config, dict]:
    """(params, opt_state, config, meta) of a training checkpoint, replicated or on ``mesh``;
    ``params_only`` leaves the optimizer state on disk (opt_state None)."""
    run, step = resolve_checkpoint(path)
    meta = Checkpointer.read_meta(run, step)
    cfg = config_from_meta(meta)
    mesh = mesh or make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    abstract = abstract_train_state(cfg, mesh)
    if params_only:
        del abstract["opt_state"]
    ck = Checkpointer(run, cfg.checkpoint, read_only=True)
    try:
        state, meta = ck.restore(step, abstract)
    finally:
        ck.close()
    return state["params"], state.get("opt_state"), cfg, meta


def load_params(path: str | Path, dtype: str | None = None) -> tuple[Any, Config]:
    """(params, config) from an olmax weights dir, a run/checkpoint dir, or ``hf:DIR``; weights
    holding a NaN or an infinity are refused (generate, chat, serve and eval never run on them)."""
    s = str(path)
    if s.startswith("hf:"):
        params, cfg = load_hf_params(s[3:], dtype=dtype)
    elif not io.is_remote(s) and not Path(s).exists():
        raise FileNotFoundError(f"checkpoint {Path(s)} does not exist")
    elif not io.is_remote(s) and is_weights_dir(s):
        params, cfg = load_weights(s, dtype=dtype)
    else:
        params, _, cfg, _ = restore_train_state(s, params_only=True)
        if dtype is not None:
            params = jax.tree.map(lambda a: a.astype(dtype), params)
    check_finite(params, f"checkpoint {s}")
    return params, cfg


def check_finite(params: Any, what: str) -> None:
    """A ``ConfigError`` naming the first parameter of ``params`` that holds a NaN or an infinity.
    Host (numpy) arrays are checked on the host: on the device each shape would compile a program
    of its own (about half a second of every ``olmax generate`` process on a 6-layer model)."""
    import jax.numpy as jnp
    import numpy as np
    for key, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue
        finite = np.isfinite(leaf).all() if isinstance(leaf, np.ndarray) else jnp.all(jnp.isfinite(leaf))
        if not bool(finite):
            raise ConfigError(f"{what}: parameter {jax.tree_util.keystr(key)} holds non-finite values (NaN or "
                              "inf): these weights are broken; use an earlier checkpoint (RUN/checkpoints/N)")
