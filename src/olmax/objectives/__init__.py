"""Training objectives: what a step optimises and what the loop, ``olmax compile`` and the CLI need
to know about it, behind one protocol (``olmax.objectives.base.Objective``).

A new objective is one module with an ``Objective`` subclass, one line here and its name in
``train.objective``'s list in ``olmax.config`` (which cannot import this package: config is the
lowest layer; ``tests/test_objectives.py`` keeps the two lists equal). Entries are
``"module:Class"`` strings, imported when a run asks for them, so this table costs no JAX import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from olmax.config import Config
    from olmax.objectives.base import Objective

OBJECTIVES: dict[str, str] = {
    "lm": "olmax.objectives.lm:LanguageModel",    # pre-training and SFT: next-token CE
    "dpo": "olmax.objectives.dpo:Dpo",            # preference pairs, cached reference log-probs
    "grpo": "olmax.objectives.grpo:Grpo",         # RL: rollouts from the policy, verifiable rewards
}


def get_objective(cfg: Config) -> Objective:
    """The objective ``cfg.train.objective`` names, bound to ``cfg``."""
    name = cfg.train.objective
    if name not in OBJECTIVES:  # config validation says this first; a config built by hand may not
        from olmax.config import ConfigError
        raise ConfigError(f"train.objective: expected one of {', '.join(map(repr, OBJECTIVES))}, got {name!r}")
    module, _, cls = OBJECTIVES[name].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg)
