"""Objectives behind one protocol (``olmax.objectives``): the registry and the config agree, every
registered objective's update lowers with the batch it declares, a toy objective registered here
trains through the unchanged loop, and nothing outside the objectives (and config validation)
compares objective names."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ConfigError, TrainConfig
from olmax.model.loss import token_logps
from olmax.objectives import OBJECTIVES, get_objective
from olmax.objectives.accumulate import accumulate, jit_update, micro_sharding, optimizer_update
from olmax.objectives.base import Objective
from olmax.recipes import get_recipe
from olmax.sharding import batch_sharding
from trainlib import SMALL

SRC = Path(__file__).resolve().parents[1] / "src" / "olmax"
MODEL = [o for o in SMALL if o.startswith("model.")]


def test_registry_and_config_name_the_same_objectives():
    # config.py cannot import the registry (olmax.objectives imports the config): the two lists
    # are kept equal here.
    assert set(typing.get_args(typing.get_type_hints(TrainConfig)["objective"])) == set(OBJECTIVES)
    for name, spec in OBJECTIVES.items():
        module, _, attr = spec.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert issubclass(cls, Objective) and cls.name == name and cls.loss_name
    for recipe in ("tiny", "tiny_sft", "tiny_dpo", "tiny_rl"):
        cfg = get_recipe(recipe)
        assert get_objective(cfg).name == cfg.train.objective and get_objective(cfg).cfg is cfg
    cfg = get_recipe("tiny")
    with pytest.raises(ConfigError, match="train.objective: expected one of 'lm', 'dpo', 'grpo', got 'nope'"):
        get_objective(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="nope")))


@pytest.mark.parametrize("recipe", ["tiny", "tiny_dpo", "tiny_rl"])
def test_each_update_lowers_with_the_batch_it_declares(recipe):
    """What ``olmax compile`` does for every objective: the jitted update lowered with the
    abstract state and ``abstract_batch`` (on the CPU mesh; nothing is allocated)."""
    from olmax.checkpoint.state import abstract_train_state, shardings
    from olmax.sharding import make_mesh, plan_batch
    cfg = get_recipe(recipe, MODEL)
    o = get_objective(cfg)
    mesh = make_mesh(cfg.mesh)
    plan = plan_batch(o.update_batch_size(), dict(mesh.shape), cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)
    st = abstract_train_state(cfg, mesh)
    lowered = o.jit_update(mesh, plan, shardings(st["params"]), shardings(st["opt_state"])).lower(
        st["params"], st["opt_state"], o.abstract_batch(mesh, plan))
    metrics = lowered.out_info[2]
    assert all(m.shape == () for m in metrics.values())
    o.loss({k: 0.0 for k in metrics})  # the update reports the loss the loop reads


# --------------------------------------------------------------------------- a toy objective


@dataclasses.dataclass
class _ToyState:
    batches_processed: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _ToyData:
    """Random tokens, a pure function of the step."""

    fingerprint = "toy"

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh

    def global_batch(self, step: int) -> dict:
        B, L = self.cfg.train.global_batch_size, self.cfg.data.sequence_length
        toks = np.random.default_rng([self.cfg.data.seed, step]).integers(0, self.cfg.model.vocab_size, (B, L))
        put = lambda x: jax.device_put(x, batch_sharding(self.mesh))  # noqa: E731
        return {"input_ids": put(toks.astype(np.int32)), "label_mask": put(np.ones((B, L), bool))}

    def state(self, done: int) -> _ToyState:
        return _ToyState(done)

    def close(self) -> None:
        pass


class Toy(Objective):
    """The mean token log-prob of random tokens, maximised: a new objective is this class and a
    registry line, nothing in the loop."""

    name = "toy"
    loss_name = "toy loss"

    def data(self, start, data_state, allow_fingerprint_mismatch, mesh, run, dataset=None):
        return _ToyData(self.cfg, mesh)

    def jit_update(self, mesh, plan, pshard, oshard):
        cfg, update = self.cfg, optimizer_update(self.cfg)

        def step(params, opt_state, batch):
            n = jnp.sum(batch["label_mask"][:, 1:].astype(jnp.float32))

            def micro_loss(p, mb):
                s = -jnp.sum(token_logps(p, mb["input_ids"], mb["label_mask"], cfg))
                return s / n, {"nll": s}

            grads, sums = accumulate(micro_loss, params, batch, plan.accum_steps, micro_sharding(mesh))
            loss = sums["nll"] / n
            new_params, new_opt, om = update(params, grads, opt_state, loss)
            return new_params, new_opt, {"loss": loss, "toy/loss": loss, "toy/tokens": n, **om}

        bshard = batch_sharding(mesh)
        return jit_update(step, pshard, oshard, {"input_ids": bshard, "label_mask": bshard})

    def abstract_batch(self, mesh, plan):
        shape = (self.update_batch_size(), self.cfg.data.sequence_length)
        return {k: jax.ShapeDtypeStruct(shape, dt, sharding=batch_sharding(mesh)) for k, dt in
                (("input_ids", jnp.int32), ("label_mask", jnp.bool_))}


@pytest.mark.integration  # a whole training run: `make test` stays under 8 minutes
def test_a_new_objective_trains_through_the_unchanged_loop(tmp_path, monkeypatch):
    from olmax.train.loop import train
    monkeypatch.setitem(OBJECTIVES, "toy", f"{__name__}:Toy")
    cfg = get_recipe("tiny", [*SMALL, "train.steps=4", "train.micro_batch_size=4", "optim.lr=1e-2"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="toy"))  # past the config's list
    res = train(cfg, tmp_path / "run", progress=False)
    assert sorted(res.losses) == [1, 2, 3, 4] and res.losses[4] < res.losses[1]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["toy/loss"] == pytest.approx(res.losses[1]) and rows[0]["toy/tokens"] == 8 * 15
    assert "train/CE loss" not in rows[0]  # the objective chose what it logs
    assert rows[-1]["throughput/total tokens"] == 4 * 8 * 16
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


# --------------------------------------------------------------------------- no name tests elsewhere


def _objective_name_tests(tree: ast.AST) -> list[int]:
    """Lines that compare ``<x>.objective`` (or index a table with it) instead of calling the objective."""
    def is_objective(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "objective"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(is_objective(x) for x in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_objective(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Match) and is_objective(node.subject):
            lines.append(node.lineno)
    return lines


def test_nothing_outside_the_objectives_tests_objective_names():
    """The loop, ``olmax compile``, rollouts and the CLI call the objective; they never ask which
    one it is. Allowed: the objectives themselves and config validation (which checks sections
    that only one objective reads)."""
    allowed = {SRC / "config.py"}
    found = [f"{p.relative_to(SRC.parent)}:{line}" for p in sorted(SRC.rglob("*.py"))
             if (SRC / "objectives") not in p.parents and p not in allowed
             for line in _objective_name_tests(ast.parse(p.read_text()))]
    assert found == [], "objective names compared outside olmax.objectives (call the objective instead): " + \
        ", ".join(found)
    # the check can fail: it finds the comparisons the loop used to make
    assert _objective_name_tests(ast.parse('rl = cfg.train.objective == "grpo"\nx = NAMES[cfg.train.objective]')) \
        == [1, 2]
