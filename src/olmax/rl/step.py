"""One RL step as the training loop runs it: rollouts in, ``num_mini_batches x num_epochs``
optimizer updates out (``olmax.rl.grpo``), on the trainer's mesh.

Before the first update the policy's log-probs of the batch (``old_logps``) are computed by the
training forward; they are the ratio's denominator, the truncated-importance-sampling reference,
and, against the log-probs the generator reported while sampling, the proof that rollouts came
from these very weights: ``rl/max_logprob_gap`` (0 on CPU devices in fp32 and bf16, where the training
forward repeats the kernels' decode arithmetic; rounding elsewhere; vLLM-based trainers see 1e-2
and more, hence their importance-weight truncation).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import jax
import numpy as np

from olmax.config import Config
from olmax.model.dispatch import can_reproduce_decode_bits
from olmax.rl import grpo
from olmax.rl.rollout import max_gap, updates_per_step
from olmax.sharding import BatchPlan, activation_mesh, batch_sharding

KEYS_2D = ("input_ids", "completion_mask", "old_logps", "gen_logps", "ref_logps")


def loss_options(cfg: Config) -> grpo.GrpoLoss:
    r = cfg.rl
    return grpo.GrpoLoss(eps_low=r.clip_low, eps_high=r.clip_high, aggregation=r.aggregation, beta=r.kl_beta,
                         tis_cap=r.tis_cap)


class RlStep:
    """``step(params, opt_state, (batch, rollout_metrics)) -> (params, opt_state, metrics)``."""

    def __init__(self, cfg: Config, mesh: Any, plan: BatchPlan, pshard: Any, oshard: Any,
                 reference: Any = None):
        from olmax.optim import apply_update
        self.cfg, self.mesh = cfg, mesh
        r = cfg.rl
        self.updates = updates_per_step(cfg)
        self.reference = reference
        loss = loss_options(cfg)
        update = partial(apply_update, optim_cfg=cfg.optim, total_steps=cfg.train.steps * self.updates)
        micro = (lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim)))
        keys = {"input_ids", "completion_mask", "old_logps", "advantages", "row_valid"}
        if r.tis_cap is not None:
            keys.add("gen_logps")
        if reference is not None:
            keys.add("ref_logps")
        self.keys = sorted(keys)
        bshard = {k: batch_sharding(mesh, 2 if k in KEYS_2D else 1) for k in self.keys}
        # Where the rollouts decode with olmax's CPU kernels, the training forward repeats their
        # arithmetic (the old log-probs' and every update's forward): the old log-probs are the
        # sampler's bit for bit (``rl/max_logprob_gap`` 0).
        self.exact = can_reproduce_decode_bits(cfg.model, mesh)
        self._update = jax.jit(grpo.make_grpo_step(cfg, loss, plan.accum_steps, update, micro_constraint=micro,
                                                   mesh=mesh, exact=self.exact),
                               in_shardings=(pshard, oshard, bshard), out_shardings=(pshard, oshard, None),
                               donate_argnums=(0, 1))
        self._bshard = bshard
        s2 = batch_sharding(mesh, 2)

        def logps(p, t, m):
            with activation_mesh(mesh):
                return jax.lax.stop_gradient(grpo._logps(p, t, m, cfg, self.exact))

        self._logps = jax.jit(logps, in_shardings=(pshard, s2, s2), out_shardings=s2)

    def _update_resharded(self, params: Any, opt_state: Any, mb: dict[str, jax.Array]):
        """One update on a mini-batch: a row block sliced from the batch on the device, which
        comes out of the slice laid out as XLA chose, put back in the update's batch layout
        (a no-op where it already is; jit takes no other layout for an array on a mesh)."""
        return self._update(params, opt_state, {k: jax.device_put(v, self._bshard[k]) for k, v in mb.items()})

    def __call__(self, params: Any, opt_state: Any, item: tuple[dict[str, np.ndarray], dict[str, float]]):
        batch, rollout_metrics = item
        r = self.cfg.rl
        t0 = time.perf_counter()
        put = (lambda v: jax.device_put(v, batch_sharding(self.mesh, np.ndim(v))))
        dev = {k: put(batch[k]) for k in ("input_ids", "generated_mask", *self.keys) if k in batch}
        dev["old_logps"] = self._logps(params, dev["input_ids"], dev["generated_mask"])
        gap = max_gap(_whole(dev["old_logps"]), batch["gen_logps"], batch["generated_mask"])
        if self.reference is not None:
            dev["ref_logps"] = self._logps(self.reference, dev["input_ids"], dev["generated_mask"])
        params, opt_state, rows = grpo.train_on_batch(params, opt_state, {k: dev[k] for k in self.keys},
                                                      self._update_resharded, num_mini_batches=r.num_mini_batches,
                                                      num_epochs=r.num_epochs)
        t_train = time.perf_counter() - t0
        last = rows[-1]
        mean = (lambda k: float(np.mean([x[k] for x in rows])))
        metrics = {**last, "loss": mean("loss"), "rl/loss": mean("loss"),
                   "rl/clip_fraction": mean("clip_fraction"), "rl/kl": mean("kl"), "rl/ratio_mean": mean("ratio_mean"),
                   "rl/trained_tokens": float(np.sum(batch["completion_mask"])),
                   "rl/max_logprob_gap": gap, "rl/time_training_s": t_train,
                   "rl/updates": float(len(rows)), **rollout_metrics}
        t_gen = rollout_metrics.get("rl/time_generation_s", 0.0)
        metrics["rl/generation_share"] = t_gen / (t_gen + t_train) if t_gen + t_train > 0 else 0.0
        for k in ("clip_fraction", "kl", "ratio_mean", "tokens"):
            metrics.pop(k, None)
        # the loop checkpoints this step's state: any update skipped or non-finite counts
        metrics["step_skipped"] = max(x["step_skipped"] for x in rows)
        metrics["nonfinite"] = max(x["nonfinite"] for x in rows)
        return params, opt_state, metrics


def _whole(x: jax.Array) -> np.ndarray:
    """``x`` on the host, whole, on every process (each process's devices hold only its rows)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
