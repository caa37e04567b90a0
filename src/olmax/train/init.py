"""What a run sets up before its first step, apart from the loop and its objective's data: the warm
start and the provenance written into every checkpoint."""

from __future__ import annotations

import importlib.metadata as md
import platform
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from olmax.checkpoint.load import load_params, restore_train_state
from olmax.config import Config, ConfigError, model_differences
from olmax.optim import init_opt_state


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("olmax", "jax", "jaxlib", "optax", "orbax-checkpoint", "grain", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def load_initial_state(cfg: Config, init_from: str, mesh: jax.sharding.Mesh, pshard: Any, oshard: Any
                       ) -> tuple[Any, Any]:
    """Warm start: ``hf:DIR`` (HF Olmo3 weights, fresh optimizer), ``olmax:PATH`` (weights of an
    olmax weights dir or checkpoint, fresh optimizer), or ``state:PATH`` (a checkpoint's weights
    *and Adam moments* with the step reset, as OLMo 3 stage 2 starts from stage 1: the trainer
    step and lr schedule restart while Adam's bias-correction step carries on, as OLMo-core
    does when it loads optimizer state; the skip-step history starts empty with the new data)."""
    kind, _, path = init_from.partition(":")
    if kind not in ("hf", "olmax", "state") or not path:
        raise ConfigError(f"train.init_from={init_from!r}: expected 'hf:DIR', 'olmax:PATH' or 'state:PATH'")
    if "://" not in path and not Path(path).exists():
        raise ConfigError(f"train.init_from={init_from!r}: {path} does not exist")
    try:
        return _load_initial_state(cfg, kind, path, mesh, pshard, oshard)
    except ConfigError as e:
        if type(e) is not ConfigError or "init_from" in str(e):
            raise
        raise ConfigError(f"train.init_from={init_from!r}: {e}") from None


def _load_initial_state(cfg: Config, kind: str, path: str, mesh: jax.sharding.Mesh, pshard: Any, oshard: Any
                        ) -> tuple[Any, Any]:
    opt_state = None
    if kind == "state":
        params, opt, src_cfg, _ = restore_train_state(path, mesh)
        opt_state = opt._replace(step=jnp.zeros_like(opt.step), history_count=jnp.zeros_like(opt.history_count),
                                 loss_history=jnp.zeros_like(opt.loss_history),
                                 norm_history=jnp.zeros_like(opt.norm_history))
        if opt.loss_history.shape != (cfg.optim.skip_step.window,):
            raise ConfigError(f"{path}: skip-step window {opt.loss_history.shape[0]} differs from "
                              f"optim.skip_step.window={cfg.optim.skip_step.window}")
    else:
        params, src_cfg = load_params(f"hf:{path}" if kind == "hf" else path)
    # A warm start may change the parameter dtype (bf16 HF weights into fp32 master weights).
    diffs = model_differences(src_cfg.model, cfg.model, ignore=frozenset({"param_dtype"}))
    if diffs:
        raise ConfigError(f"the weights in {path} are a different model: " + "; ".join(
            f"model.{f}: the weights have {a!r}, the config has {b!r}" for f, a, b in diffs))
    params = jax.tree.map(lambda a: jnp.asarray(a, cfg.model.param_dtype), params)
    params = jax.device_put(params, pshard)
    if opt_state is None:
        opt_state = jax.jit(partial(init_opt_state, optim_cfg=cfg.optim), out_shardings=oshard)(params)
    else:
        opt_state = jax.device_put(opt_state, oshard)
    return params, opt_state
