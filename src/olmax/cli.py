"""The ``olmax`` command line. Subcommands live beside the code they drive; each module
exposes ``register(subparsers)`` and sets ``func`` on its parsers."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from olmax.config import ConfigError

# Modules that add subcommands, in help order.
COMMAND_MODULES = [
    "olmax.commands",
    "olmax.compile",
    "olmax.train.commands",
    "olmax.data.commands",
    "olmax.compat.commands",
    "olmax.verify.parity",
    "olmax.verify.commands",
    "olmax.eval.commands",
    "olmax.launch.commands",
]


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe name (tiny, olmo3_7b_stage1, ...) or a resolved config .yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=100 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmax", description="Faithful, verified LLM pre-training in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    from olmax.eval.commands import register_compare
    register_compare(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e)}))
        print(f"error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
