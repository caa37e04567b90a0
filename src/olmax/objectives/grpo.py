"""The GRPO objective (``train.objective=grpo``): one RL step as the training loop runs it,
rollouts in, ``num_mini_batches x num_epochs`` optimizer updates out, on the trainer's mesh. The
loss and its pieces are ``olmax.rl.grpo``'s; the rollouts ``olmax.rl.rollout``'s.

Before the first update the policy's log-probs of the batch (``old_logps``) are computed by the
training forward; they are the ratio's denominator, the truncated-importance-sampling reference,
and, against the log-probs the generator reported while sampling, the proof that rollouts came
from these very weights: ``rl/max_logprob_gap`` (0 on CPU devices in fp32 and bf16, where the training
forward repeats the kernels' decode arithmetic; rounding elsewhere; vLLM-based trainers see 1e-2
and more, hence their importance-weight truncation).

With ``rl.pack_length`` the rollout batch (one completion a row) is packed into training rows of
that length before anything is computed on it (``olmax.rl.packing``): the old and reference
log-probs, the gap and every update see the packed rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import Config
from olmax.model.dispatch import can_reproduce_decode_bits
from olmax.objectives.accumulate import accumulate, jit_update, micro_sharding, optimizer_update
from olmax.objectives.base import Objective
from olmax.optim import apply_update
from olmax.rl import packing
from olmax.rl.grpo import GrpoLoss, aggregate, per_token_terms, policy_logps, token_mask, train_on_batch
from olmax.rl.rollout import RlData, max_gap
from olmax.sharding import BatchPlan, activation_mesh, batch_sharding, split_micro

KEYS_2D = ("input_ids", "completion_mask", "old_logps", "gen_logps", "ref_logps", "positions", "segment_ids")
DTYPES = {"input_ids": jnp.int32, "completion_mask": jnp.bool_, "row_valid": jnp.bool_, "positions": jnp.int32,
          "segment_ids": jnp.int32}  # the rest: float32


def loss_options(cfg: Config) -> GrpoLoss:
    r = cfg.rl
    return GrpoLoss(eps_low=r.clip_low, eps_high=r.clip_high, aggregation=r.aggregation, beta=r.kl_beta,
                    tis_cap=r.tis_cap)


def update_keys(cfg: Config) -> list[str]:
    """The arrays of one update's batch: ``gen_logps`` with truncated importance sampling,
    ``ref_logps`` with a KL term; packed rows (``rl.pack_length``) carry their documents
    (``positions``, ``segment_ids``), per-token ``advantages`` and ``row_sequences`` in place of
    ``row_valid``."""
    keys = {"input_ids", "completion_mask", "old_logps", "advantages"}
    keys |= {"positions", "segment_ids", "row_sequences"} if cfg.rl.pack_length else {"row_valid"}
    if cfg.rl.tis_cap is not None:
        keys.add("gen_logps")
    if cfg.rl.kl_beta > 0:
        keys.add("ref_logps")
    return sorted(keys)


def is_2d(key: str, cfg: Config) -> bool:
    """Whether ``key`` of an update's batch is [rows, L] (else [rows])."""
    return key in KEYS_2D or (key == "advantages" and cfg.rl.pack_length is not None)


def row_length(cfg: Config) -> int:
    """Tokens of a training row: ``rl.pack_length`` when packing, else ``data.sequence_length``."""
    return cfg.rl.pack_length or cfg.data.sequence_length


def updates_per_step(cfg: Config) -> int:
    """Optimizer updates per RL step: ``rl.num_epochs`` passes over ``rl.num_mini_batches``."""
    return cfg.rl.num_mini_batches * cfg.rl.num_epochs


# --------------------------------------------------------------------------- one update


def make_grpo_step(cfg: Any, loss: GrpoLoss, accum_steps: int, apply_update: Callable,
                   micro_constraint: Callable[[jax.Array], jax.Array] | None = None, mesh: Any = None,
                   exact: bool = False) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted); ``cfg`` is
    an olmax ``Config`` (its ``model`` section is used).

    ``batch``: ``input_ids`` [n, L], ``completion_mask`` [n, L], ``advantages`` [n], ``old_logps``
    [n, L]; ``gen_logps`` [n, L] with ``loss.tis_cap``; ``ref_logps`` [n, L] with ``loss.beta``
    (or to report the KL); optional ``row_valid`` [n] bool: rows that count as sequences (the RL
    loop's filtered groups are rows with no trained token and ``row_valid`` False; without it all n
    rows count). Packed rows (``olmax.rl.packing``): ``positions`` and ``segment_ids`` [n, L],
    ``advantages`` [n, L], ``row_sequences`` [n] (the documents of each row, the sequences counted);
    ``microbatch_mean`` then divides by the micro-batches that hold a document (open-instruct: the
    packed micro-batches of the mini-batch). n must divide by ``accum_steps``. Metrics: ``loss``, ``clip_fraction``
    (share of completion tokens whose clipped term is the one taken, TRL's ``clip_ratio/region_mean``),
    ``kl`` (token mean of k3 to the reference, 0 without one), ``ratio_mean``, ``tokens``, and the
    optimizer's (``grad_norm``: the pre-clip gradient norm, ``lr``, ...). ``exact``: the
    log-probs as ``policy_logps(exact=True)`` computes them (RL on the CPU kernels)."""

    def step(params, opt_state, batch):
        with activation_mesh(mesh):
            return _step(params, opt_state, batch)

    def _step(params, opt_state, batch):
        n = batch["input_ids"].shape[0]
        if n % accum_steps:
            raise ValueError(f"{n} rows do not split into {accum_steps} micro-batches")
        total_tokens = jnp.sum(token_mask(batch["completion_mask"]))
        micro_batches = accum_steps
        if "row_sequences" in batch:  # packed rows
            sequences = jnp.maximum(jnp.sum(batch["row_sequences"]), 1.0)
            held = jnp.sum(split_micro(batch["row_sequences"], accum_steps), axis=1) > 0
            micro_batches = jnp.maximum(jnp.sum(held.astype(jnp.float32)), 1.0)
        elif "row_valid" in batch:
            sequences = jnp.maximum(jnp.sum(batch["row_valid"].astype(jnp.float32)), 1.0)
        else:
            sequences = n

        def micro_loss(p, mb):  # this micro-batch's share of the batch loss, and its metric sums
            mask = token_mask(mb["completion_mask"])
            logp = policy_logps(p, mb["input_ids"], mb["completion_mask"], cfg, exact, mb.get("positions"),
                                mb.get("segment_ids"))
            t = per_token_terms(logp, mb["old_logps"], mb["advantages"], loss, mb.get("gen_logps"),
                                mb.get("ref_logps"))
            share = aggregate(t["loss"], mask, loss.aggregation, total_tokens=total_tokens, total_sequences=sequences,
                              accum_steps=micro_batches, segment_ids=mb.get("segment_ids"))
            sums = {"loss": share, "clipped": jnp.sum(t["clipped"] * mask), "kl": jnp.sum(t["kl"] * mask),
                    "ratio": jnp.sum(t["ratio"] * mask)}
            return share, jax.lax.stop_gradient(sums)

        grads, sums = accumulate(micro_loss, params, batch, accum_steps, micro_constraint)
        denom = jnp.maximum(total_tokens, 1.0)
        new_params, new_opt, om = apply_update(params, grads, opt_state, sums["loss"])
        metrics = {"loss": sums["loss"], "clip_fraction": sums["clipped"] / denom, "kl": sums["kl"] / denom,
                   "ratio_mean": sums["ratio"] / denom, "tokens": total_tokens, **om}
        return new_params, new_opt, metrics

    return step


def jit_grpo_step(cfg: Any, loss: GrpoLoss, accum_steps: int, total_steps: int) -> Callable:
    """The step jitted on one device with olmax's optimizer (``cfg.optim``; ``total_steps`` sizes
    the lr schedule); params and optimizer state donated."""
    update = partial(apply_update, optim_cfg=cfg.optim, total_steps=total_steps)
    return jax.jit(make_grpo_step(cfg, loss, accum_steps, update), donate_argnums=(0, 1))


# --------------------------------------------------------------------------- one RL step


class RlStep:
    """``step(params, opt_state, (batch, rollout_metrics)) -> (params, opt_state, metrics)``.

    ``reference``: the frozen weights of the KL term (with ``rl.kl_beta`` > 0; ``olmax compile``
    lowers ``update`` without them)."""

    def __init__(self, cfg: Config, mesh: Any, plan: BatchPlan, pshard: Any, oshard: Any,
                 reference: Any = None):
        self.cfg, self.mesh, self.plan = cfg, mesh, plan
        self.reference = reference
        self._loss = loss_options(cfg)
        self._optimizer = optimizer_update(cfg, updates_per_step(cfg))
        self._pshard, self._oshard = pshard, oshard
        self.keys = update_keys(cfg)
        self._bshard = {k: batch_sharding(mesh, 2 if is_2d(k, cfg) else 1) for k in self.keys}
        # Where the rollouts decode with olmax's CPU kernels, the training forward repeats their
        # arithmetic (the old log-probs' and every update's forward): the old log-probs are the
        # sampler's bit for bit (``rl/max_logprob_gap`` 0).
        self.exact = can_reproduce_decode_bits(cfg.model, mesh)
        self._updates: dict[int, Callable] = {}
        self._accum = plan.accum_steps  # this step's micro-batches per update
        # one optimizer update, jitted (what ``olmax compile`` lowers: packed, the most rows, one
        # completion a row)
        self.update = self._update_for(plan.accum_steps)
        s2 = batch_sharding(mesh, 2)

        def logps(p, t, m, *docs):
            with activation_mesh(mesh):
                return jax.lax.stop_gradient(policy_logps(p, t, m, cfg, self.exact, *docs))

        self._logps = jax.jit(logps, in_shardings=(pshard, s2, s2), out_shardings=s2)
        self._packed_logps = jax.jit(logps, in_shardings=(pshard, s2, s2, s2, s2), out_shardings=s2)

    def _update_for(self, accum_steps: int) -> Callable:
        """The jitted update of a mini-batch of ``accum_steps`` micro-batches (packed rows: one
        program per bucket of rows, ``olmax.rl.packing``)."""
        if accum_steps not in self._updates:
            step = make_grpo_step(self.cfg, self._loss, accum_steps, self._optimizer,
                                  micro_constraint=micro_sharding(self.mesh), mesh=self.mesh, exact=self.exact)
            self._updates[accum_steps] = jit_update(step, self._pshard, self._oshard, self._bshard)
        return self._updates[accum_steps]

    def _update_resharded(self, params: Any, opt_state: Any, mb: dict[str, jax.Array]):
        """One update on a mini-batch: a row block sliced from the batch on the device, which
        comes out of the slice laid out as XLA chose, put back in the update's batch layout
        (a no-op where it already is; jit takes no other layout for an array on a mesh)."""
        update = self._update_for(self._accum) if self.cfg.rl.pack_length else self.update
        return update(params, opt_state, {k: jax.device_put(v, self._bshard[k]) for k, v in mb.items()})

    def training_rows(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """The rollout batch (one completion a row) as the update trains it, and its micro-batches
        per update: packed into rows of ``rl.pack_length`` (``olmax.rl.packing``), or as it is."""
        r = self.cfg.rl
        if not r.pack_length:
            return batch, self.plan.accum_steps
        return packing.pack_batch(batch, r.pack_length, r.num_mini_batches, self.plan.data_parallel,
                                  self.plan.micro_batch, self.cfg.data.pad_token_id or 0)

    def __call__(self, params: Any, opt_state: Any, item: tuple[dict[str, np.ndarray], dict[str, float]]):
        batch, rollout_metrics = item
        r = self.cfg.rl
        t0 = time.perf_counter()
        trained_tokens = float(np.sum(batch["completion_mask"]))
        batch, self._accum = self.training_rows(batch)
        put = (lambda v: jax.device_put(v, batch_sharding(self.mesh, np.ndim(v))))
        dev = {k: put(batch[k]) for k in ("input_ids", "generated_mask", *self.keys) if k in batch}
        docs = (dev["positions"], dev["segment_ids"]) if r.pack_length else ()
        logps = self._packed_logps if r.pack_length else self._logps
        dev["old_logps"] = logps(params, dev["input_ids"], dev["generated_mask"], *docs)
        gap = max_gap(_whole(dev["old_logps"]), batch["gen_logps"], batch["generated_mask"])
        if self.reference is not None:
            dev["ref_logps"] = logps(self.reference, dev["input_ids"], dev["generated_mask"], *docs)
        params, opt_state, rows = train_on_batch(params, opt_state, {k: dev[k] for k in self.keys},
                                                 self._update_resharded, num_mini_batches=r.num_mini_batches,
                                                 num_epochs=r.num_epochs)
        t_train = time.perf_counter() - t0
        last = rows[-1]
        mean = (lambda k: float(np.mean([x[k] for x in rows])))
        shape = np.shape(batch["input_ids"])
        metrics = {**last, "loss": mean("loss"), "rl/loss": mean("loss"),
                   "rl/clip_fraction": mean("clip_fraction"), "rl/kl": mean("kl"), "rl/ratio_mean": mean("ratio_mean"),
                   "rl/trained_tokens": trained_tokens,
                   "rl/padding_share": packing.padding_share(batch["lengths"], shape[0], shape[1]),
                   "rl/training_rows": float(shape[0]),
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


# --------------------------------------------------------------------------- the objective


class Grpo(Objective):
    """``train.objective=grpo``: ``global_batch_size`` completions a step (``rl.prompts_per_step x
    rl.group_size``), sampled from the current weights; one update per mini-batch and epoch."""

    name = "grpo"
    loss_name = "policy loss"
    empty_batch = ("no completion token left in the loss: every group's rewards equal (rl.filter_zero_std drops such "
                   "groups) or every completion empty; a mean over no token is 0/0")
    samples = True

    def updates_per_step(self) -> int:
        return updates_per_step(self.cfg)

    def update_batch_size(self) -> int:
        return self.cfg.train.global_batch_size // self.cfg.rl.num_mini_batches  # one mini-batch of completions

    def data(self, start: int, data_state: dict | None, allow_fingerprint_mismatch: bool, mesh: Mesh, run: Path,
             dataset: Any = None) -> RlData:
        return RlData(self.cfg, start, data_state, allow_fingerprint_mismatch, mesh, run)

    def batch(self, data: RlData, step: int, params: Any) -> Any:
        return data.rollouts(step, params)  # sampled from the weights this step updates

    def jit_update(self, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Callable:
        return RlStep(self.cfg, mesh, plan, pshard, oshard).update

    def abstract_batch(self, mesh: Mesh, plan: BatchPlan) -> dict[str, jax.ShapeDtypeStruct]:
        # packed (rl.pack_length): the most rows a mini-batch packs into, one completion a row
        n, L = self.update_batch_size(), row_length(self.cfg)
        return {k: jax.ShapeDtypeStruct((n, L) if is_2d(k, self.cfg) else (n,), DTYPES.get(k, jnp.float32),
                                        sharding=batch_sharding(mesh, 2 if is_2d(k, self.cfg) else 1))
                for k in update_keys(self.cfg)}

    def loop_step(self, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any,
                  initial_params: Callable[[], Any]) -> RlStep:
        # KL to the initial weights: a frozen second copy, only when rl.kl_beta > 0
        reference = initial_params() if self.cfg.rl.kl_beta > 0 else None
        return RlStep(self.cfg, mesh, plan, pshard, oshard, reference=reference)

    def trained_tokens(self, metrics: dict[str, float]) -> float | None:
        return metrics.get("rl/trained_tokens")

    def step_seconds(self, metrics: dict[str, float], wall: float) -> float:
        # the RL step is synchronous: its own clock (sampling + updates) times it
        return metrics.get("rl/time_generation_s", 0.0) + metrics.get("rl/time_training_s", 0.0)
