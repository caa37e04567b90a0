"""The train state as shapes and shardings: what a restore targets and the step is compiled for.

Kept apart from the loop so that loading, export and ahead-of-time compilation can build it
without importing the training loop."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from olmax.config import Config
from olmax.model.params import init_params, logical_axes
from olmax.optim import init_opt_state
from olmax.sharding import param_shardings


def abstract_train_state(cfg: Config, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """``{"params", "opt_state"}`` as ``jax.ShapeDtypeStruct``s carrying their shardings on ``mesh``
    (nothing allocated): the target of a restore and the source of the step's shardings. Adam's
    moments are sharded like the parameters; counters and the skip-step history are replicated."""
    pshard = param_shardings(logical_axes(cfg.model), mesh)
    p_abs = jax.eval_shape(partial(init_params, cfg.model), jax.random.key(0))
    o_abs = jax.eval_shape(partial(init_opt_state, optim_cfg=cfg.optim), p_abs)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    oshard = jax.tree.map(lambda _: rep, o_abs)._replace(mu=pshard, nu=pshard)
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    return {"params": jax.tree.map(sds, p_abs, pshard), "opt_state": jax.tree.map(sds, o_abs, oshard)}


def shardings(abstract: Any) -> Any:
    return jax.tree.map(lambda a: a.sharding, abstract)
