"""The language-model objective (pre-training and SFT): next-token cross-entropy over token
instances (``olmax.model.loss``, whose docstring states the rule and its denominator), gradients
accumulated over micro-batches (``olmax.objectives.accumulate``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import Config, ConfigError
from olmax.data.loader import DataLoader, DataState, global_batch_to_device
from olmax.model.loss import head_loss, loss_denominator, per_rank_weights, whole_rows_count, with_documents
from olmax.objectives.accumulate import accumulate, jit_update, micro_sharding, optimizer_update
from olmax.objectives.base import TRAINED_TOKENS, Objective
from olmax.sharding import BatchPlan, activation_mesh, batch_sharding


def make_lm_step(cfg: Config, accum_steps: int, apply_update: Callable,
                 micro_constraint: Callable[[jax.Array], jax.Array] | None = None,
                 mesh: Mesh | None = None) -> Callable:
    """Returns ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted).

    ``apply_update(params, grads, opt_state, ce_loss)`` is the optimiser (``olmax.optim``).
    With ``mesh``, activations are pinned to it by logical axes while the step is traced."""
    z_mult = cfg.optim.z_loss or 0.0

    def step(params, opt_state, batch):
        with activation_mesh(mesh):
            return _step(params, opt_state, batch)

    def _step(params, opt_state, batch):
        batch = with_documents(batch, cfg)  # positions and segment ids, traced, when data.document_masking
        trained = jnp.sum(batch["label_mask"][:, 1:].astype(jnp.float32))  # labels after the shift
        if cfg.train.loss_ranks > 1:  # OLMo-core's per-rank token mean: weights carry the denominators
            batch = {**batch, "label_mask": per_rank_weights(batch["label_mask"], cfg.train.loss_ranks,
                                                             jax.process_count())}
            denom = jnp.float32(1.0)
        else:
            denom = loss_denominator(batch["label_mask"], whole_rows_count(cfg))

        def micro_loss(p, mb):
            total, (ce, z) = head_loss(p, mb, cfg)
            return total / denom, (ce, z)

        grads, (ce_sum, z_sum) = accumulate(micro_loss, params, batch, accum_steps, micro_constraint)
        ce_loss = ce_sum / denom
        z_loss = z_mult * z_sum / denom
        new_params, new_opt, om = apply_update(params, grads, opt_state, ce_loss)
        metrics = {"ce_loss": ce_loss, "z_loss": z_loss, TRAINED_TOKENS: trained, **om}
        return new_params, new_opt, metrics

    return step


def jit_lm_step(cfg: Config, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Callable:
    """The production train step: jitted with the state's shardings, the batch split over the
    data-parallel axes, and the old state donated (updated in place). The loop runs it; ``olmax
    compile`` lowers it for a TPU topology."""
    bshard = batch_sharding(mesh)
    step = make_lm_step(cfg, plan.accum_steps, optimizer_update(cfg), micro_constraint=micro_sharding(mesh), mesh=mesh)
    return jit_update(step, pshard, oshard, {"input_ids": bshard, "label_mask": bshard})


def check_trained_labels(dataset: Any, cfg: Config, sample: int = 256) -> None:
    """Label-masked data (SFT) whose instances hold no trained label is refused before training:
    up to ``sample`` instances spread over the dataset are read, and when none holds a trained
    label the cause is nearly always a sequence shorter than every prompt."""
    if not getattr(dataset, "has_label_masks", getattr(dataset, "label_masked", False)) or len(dataset) == 0:
        return
    ids = np.unique(np.linspace(0, len(dataset) - 1, min(len(dataset), sample)).astype(np.int64))
    trained = dataset.read_label_mask(ids)[:, 1:].any(axis=1)
    if not trained.any():
        L = cfg.data.sequence_length
        raise ConfigError(f"data.sequence_length={L}: none of the {len(ids)} instances read across data.paths holds "
                          f"a trained token (label masks all 0 within {L} tokens): the conversations' prompts are "
                          "longer than the sequence, or the label-mask files mask everything; raise "
                          "data.sequence_length")
    if not trained.all() and jax.process_index() == 0:
        print(f"olmax: WARNING {int((~trained).sum())} of {len(ids)} instances read across data.paths hold no "
              f"trained token within data.sequence_length={cfg.data.sequence_length}: those rows train on nothing",
              file=sys.stderr, flush=True)


class TrainData:
    """The loader as the loop sees it: global batch k as sharded ``jax.Array``s, in step order."""

    def __init__(self, cfg: Config, start_step: int, data_state: dict | None, allow_fingerprint_mismatch: bool,
                 mesh: jax.sharding.Mesh, cache_dir: Path | None = None, trace_dir: Path | None = None,
                 dataset: Any = None):
        resume = DataState.from_dict(data_state) if data_state is not None else None
        self.loader = DataLoader(cfg, process_index=jax.process_index(), process_count=jax.process_count(),
                                 start_step=start_step, resume=resume,
                                 allow_fingerprint_mismatch=allow_fingerprint_mismatch,
                                 cache_dir=cfg.data.cache_dir or cache_dir, dataset=dataset)
        self.fingerprint = self.loader.dataset.fingerprint
        check_trained_labels(self.loader.dataset, cfg)
        self.mesh = mesh
        self._it = iter(self.loader)
        self.trace = None
        if cfg.train.trace_instance_ids and trace_dir is not None:
            self.trace = open(Path(trace_dir) / f"instance_ids.p{jax.process_index()}.jsonl", "a")

    def global_batch(self, step: int) -> dict[str, jax.Array]:
        local = next(self._it)
        if int(local["step"]) != step:
            raise RuntimeError(f"data loader is at step {int(local['step'])} but the trainer is at {step}")
        if self.trace is not None:
            self.trace.write(json.dumps({"step": step, "instance_ids": local["instance_ids"].tolist()}) + "\n")
            self.trace.flush()
        return global_batch_to_device({"input_ids": local["input_ids"], "label_mask": local["label_mask"]}, self.mesh)

    def state(self, done: int):
        st = self.loader.state()
        if st.batches_processed != done:
            raise RuntimeError(f"data state says {st.batches_processed} batches processed, the trainer {done}")
        return st

    def close(self) -> None:
        self.loader.close()
        if self.trace is not None:
            self.trace.close()


class LanguageModel(Objective):
    """``train.objective=lm``: token instances of ``data.paths`` (packed, label-masked for SFT)."""

    name = "lm"
    loss_name = "CE loss"
    allows_epochs = True
    eval_by_default = True

    def data(self, start: int, data_state: dict | None, allow_fingerprint_mismatch: bool, mesh: Mesh, run: Path,
             dataset: Any = None) -> TrainData:
        return TrainData(self.cfg, start, data_state, allow_fingerprint_mismatch, mesh,
                         cache_dir=run / "order_cache", trace_dir=run, dataset=dataset)

    def jit_update(self, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Callable:
        return jit_lm_step(self.cfg, mesh, plan, pshard, oshard)

    def abstract_batch(self, mesh: Mesh, plan: BatchPlan) -> dict[str, jax.ShapeDtypeStruct]:
        shape, bshard = (self.update_batch_size(), self.cfg.data.sequence_length), batch_sharding(mesh)
        return {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bshard),
                "label_mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=bshard)}

    def loss(self, metrics: dict[str, float]) -> float:
        return metrics["ce_loss"]

    def logged(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"ce_loss": metrics["ce_loss"], "z_loss": metrics["z_loss"]}
