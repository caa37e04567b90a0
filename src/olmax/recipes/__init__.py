"""Named recipes: each returns a typed, frozen :class:`olmax.config.Config` (``olmo3``: the OLMo 3
stages, ``tiny``: the CPU demo and tests), and the ``RECIPE --set ...`` arguments of the CLI.
Bottom layer beside config: imports ``olmax.config`` only."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable

from olmax.config import Config, ConfigError, load_yaml, validate
from olmax.recipes.dpo import olmo3_7b_instruct_dpo, olmo3_7b_think_dpo, tiny_dpo
from olmax.recipes.olmo3 import olmo3_7b_stage1, olmo3_7b_stage2, olmo3_7b_stage3, olmo3_32b
from olmax.recipes.rl import olmo3_7b_instruct_rl, olmo3_7b_think_rl, tiny_rl
from olmax.recipes.sft import olmo3_7b_instruct_sft, olmo3_7b_think_sft, tiny_sft
from olmax.recipes.slices import slice_choice
from olmax.recipes.tiny import tiny

RECIPES: dict[str, Callable[[], Config]] = {
    "tiny": tiny,
    "olmo3_7b_stage1": olmo3_7b_stage1,
    "olmo3_7b_stage2": olmo3_7b_stage2,
    "olmo3_7b_stage3": olmo3_7b_stage3,
    "olmo3_32b": olmo3_32b,
    "olmo3_7b_think_dpo": olmo3_7b_think_dpo,
    "olmo3_7b_instruct_dpo": olmo3_7b_instruct_dpo,
    "tiny_dpo": tiny_dpo,
    "olmo3_7b_think_sft": olmo3_7b_think_sft,
    "olmo3_7b_instruct_sft": olmo3_7b_instruct_sft,
    "tiny_sft": tiny_sft,
    "olmo3_7b_think_rl": olmo3_7b_think_rl,
    "olmo3_7b_instruct_rl": olmo3_7b_instruct_rl,
    "tiny_rl": tiny_rl,
}


def get_recipe(name: str, overrides: list[str] | tuple[str, ...] = (), slice_name: str | None = None) -> Config:
    """Resolve a recipe by name (or a YAML file of a resolved config) and apply overrides.
    ``slice_name`` (e.g. ``v5p-128``): the TPU slice it will run on; its measured choice for that
    slice (``slices.CHOICES``) comes before the overrides, which win."""
    if name.endswith((".yaml", ".yml")):
        cfg = load_yaml(name)
    elif name in RECIPES:
        cfg = RECIPES[name]()
        choice = slice_choice(name, slice_name)
        if choice is not None:
            cfg = cfg.override(list(choice.overrides))
    else:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint} (known: {', '.join(RECIPES)}, or a .yaml file)")
    return validate(cfg.override(list(overrides)))


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    """The ``RECIPE [--set KEY=VALUE ...]`` arguments of every command that takes a recipe."""
    p.add_argument("recipe", help="recipe name (tiny, olmo3_7b_stage1, ...) or a resolved config .yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=100 (repeatable)")
