"""The objective protocol: everything the training loop, ``olmax compile`` and ``olmax train``'s
closing line ask of an objective. They look the objective up once (``olmax.objectives.
get_objective``) and call it; none of them compares objective names.

What a step returns: ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, the
metrics holding the optimizer's (``grad_norm``, ``lr``, ``step_skipped``, ``nonfinite``: see
``olmax.optim.apply_update``) beside the objective's own (``loss`` and ``logged``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jax
from jax.sharding import Mesh

from olmax.config import Config
from olmax.sharding import BatchPlan

Step = Callable[[Any, Any, Any], tuple[Any, Any, dict[str, Any]]]

# The step metric that counts the labels a step trained on (after truncation and masking): the loop
# counts the steps whose batch held none (a loss of 0/0, or DPO's log 2 for nothing).
TRAINED_TOKENS = "trained_tokens"


class Data(Protocol):
    """The loop's data source of an objective (what ``Objective.data`` returns)."""

    fingerprint: str        # of what it reads; every checkpoint holds it and a resume checks it

    def state(self, done: int) -> Any:
        """The data state after ``done`` steps: its ``to_dict()`` goes into the checkpoint."""

    def close(self) -> None: ...


class Objective(abc.ABC):
    """One training objective, bound to a run's config (``get_objective(cfg)``)."""

    name: ClassVar[str]                   # the train.objective value
    loss_name: ClassVar[str]              # its loss in messages ("CE loss"); ``TrainResult.losses`` holds it
    allows_epochs: ClassVar[bool] = False  # train.epochs counts whole global batches of its token dataset
    rows_per_example: ClassVar[int] = 1   # sequences of data.sequence_length per global-batch entry
    eval_by_default: ClassVar[bool] = False  # olmax compile compiles the held-out eval step without heldout paths
    samples: ClassVar[bool] = False       # samples from the policy between updates (compile reports generation)
    # why a step's batch can hold no trained token (the loop's warnings and errors say it)
    empty_batch: ClassVar[str] = ("every label masked, or cut away because data.sequence_length is shorter than the "
                                  "prompts; a mean over no token is 0/0")

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # -- sizes ---------------------------------------------------------------------------------

    def updates_per_step(self) -> int:
        """Optimizer updates per step; a checkpoint at step N has N x this optimizer steps."""
        return 1

    def update_batch_size(self) -> int:
        """Global-batch entries one optimizer update sees (what the batch plan splits)."""
        return self.cfg.train.global_batch_size

    def tokens_per_step(self) -> int:
        """Tokens one step trains on (throughput, ``total_tokens``)."""
        return self.cfg.train.global_batch_size * self.cfg.data.sequence_length * self.rows_per_example

    # -- data ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def data(self, start: int, data_state: dict | None, allow_fingerprint_mismatch: bool, mesh: Mesh, run: Path,
             dataset: Any = None) -> Data:
        """The data source positioned at step ``start`` (``data_state``: the checkpoint's, None
        for a fresh run); ``dataset``: the one ``resolve_epochs`` built, or None."""

    def prepare(self, data: Data, initial_params: Callable[[], Any], pshard: Any, plan: BatchPlan,
                say: Callable[[str], None]) -> None:
        """Work before the first update of this process (``initial_params()``: the weights the
        run started from; they may be the live ones, so use them before the first update only).
        Nothing by default."""
        return None

    def batch(self, data: Data, step: int, params: Any) -> Any:
        """Step ``step``'s batch, as the loop step takes it (``params``: the current weights)."""
        return data.global_batch(step)  # type: ignore[attr-defined]

    # -- the step ------------------------------------------------------------------------------

    @abc.abstractmethod
    def jit_update(self, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Any:
        """One optimizer update, jitted with the run's shardings (what ``olmax compile`` lowers
        with ``abstract_batch``)."""

    @abc.abstractmethod
    def abstract_batch(self, mesh: Mesh, plan: BatchPlan) -> dict[str, jax.ShapeDtypeStruct]:
        """The batch ``jit_update`` takes, as sharded shapes."""

    def loop_step(self, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any,
                  initial_params: Callable[[], Any]) -> Step:
        """What the loop calls once a step (``initial_params()``: a copy of the weights the run
        started from, the step may keep it)."""
        return self.jit_update(mesh, plan, pshard, oshard)

    # -- metrics -------------------------------------------------------------------------------

    def loss(self, metrics: dict[str, float]) -> float:
        """The objective's loss from a step's metrics (on the host)."""
        return metrics["loss"]

    def logged(self, metrics: dict[str, float]) -> dict[str, float]:
        """The objective's own metrics row: short names ``olmax.metrics.sinks.named`` knows, or full
        ``group/name`` ones (the default: every metric named so)."""
        return {k: v for k, v in metrics.items() if "/" in k}

    def trained_tokens(self, metrics: dict[str, float]) -> float | None:
        """The labels the step trained on (None: the objective does not count them)."""
        return metrics.get(TRAINED_TOKENS)

    def step_seconds(self, metrics: dict[str, float], wall: float) -> float:
        """The time the step took, for throughput (``wall``: between two steps' results)."""
        return wall
