"""Layers only look down: every ``olmax`` import in ``src/olmax`` (at module level and inside
functions, read with ``ast``) goes to the importer's own layer or below, and no chain of imports
returns to where it started, between modules or between packages (``olmax.train`` imports
``olmax.eval``, so nothing in eval may import train). The README's layout section describes the
same layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module belongs to the longest prefix listed; every ``*.commands`` module is CLI.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("config", ("olmax", "olmax.config", "olmax.io", "olmax.recipes")),
    # kernels: the platform kernels, which only olmax.model.dispatch calls (they import sharding).
    ("model/data", ("olmax.model", "olmax.kernels", "olmax.sharding", "olmax.optim", "olmax.data", "olmax.metrics",
                    "olmax.chat")),
    # engine: generation over the model's prefill and decode step, used by eval, RL and the tools.
    ("compat/checkpoint/engine", ("olmax.compat", "olmax.checkpoint", "olmax.engine")),
    ("train/eval", ("olmax.train", "olmax.objectives", "olmax.eval", "olmax.rl")),
    ("verify/tools", ("olmax.verify", "olmax.infer", "olmax.compile", "olmax.measure", "olmax.launch",
                      "olmax.demos", "olmax.serve")),
    ("CLI", ("olmax.cli", "olmax.commands")),
]
CLI = len(LAYERS) - 1


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "olmax").rglob("*.py")):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def layer(module: str) -> int:
    if module.endswith(".commands"):
        return CLI
    best = max((p for _, ps in LAYERS for p in ps if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, (_, ps) in enumerate(LAYERS) if best in ps)


def imports(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """``{importer: {imported module: line}}`` for every olmax import, wherever it is written."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        edges = graph.setdefault(m, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{pkg}.{base}" if base else pkg
                # ``from olmax.train import loop`` imports olmax.train.loop; ``from olmax.config import X`` config.
                names = [r for a in node.names if (r := resolve(f"{base}.{a.name}")) != resolve(base)] or [base]
            else:
                continue
            for n in names:
                target = resolve(n) if n.split(".")[0] == "olmax" else None
                if target and target != m:
                    edges.setdefault(target, node.lineno)
    return graph


def test_every_module_has_a_layer():
    for m in modules():
        layer(m)  # max() of nothing raises: add the new package to LAYERS


def test_every_package_says_what_lives_there():
    bare = [m for m, p in modules().items()
            if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"packages without a docstring (what lives there, what it may import): {bare}"


def test_imports_only_look_down():
    graph = imports(modules())
    upward = [f"{m} (line {line}) imports {t}: the {LAYERS[layer(m)][0]} layer may not import the "
              f"{LAYERS[layer(t)][0]} layer above it" for m, edges in graph.items() for t, line in edges.items()
              if layer(t) > layer(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def package(module: str) -> str | None:
    """``olmax.train.loop`` -> ``olmax.train`` (a top-level module is its own package); None for
    the CLI, which imports every package and which none imports."""
    return None if layer(module) == CLI else ".".join(module.split(".")[:2])


def cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every cycle a depth-first walk meets, as ``a (where a imports b) -> b (...) -> a``."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cyc = path[path.index(t):] + [m, t]
                found.append(" -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cyc, cyc[1:])) + f" -> {t}")
            elif t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def test_no_import_cycles():
    graph = {m: {t: f"line {line}" for t, line in edges.items()} for m, edges in imports(modules()).items()}
    found = cycles(graph)
    assert not found, "import cycles (each names the importing module and the line):\n" + "\n".join(found)


def test_no_package_cycles():
    """What two packages both need lives below both (the loss in ``olmax.model.loss``, checkpoints
    and parameter loading in ``olmax.checkpoint``), so no package imports one that imports it back."""
    graph: dict[str, dict[str, str]] = {}
    for m, edges in imports(modules()).items():
        if (a := package(m)) is None:
            continue
        out = graph.setdefault(a, {})
        for t, line in sorted(edges.items()):
            if (b := package(t)) not in (None, a):
                out.setdefault(b, f"{m} line {line} imports {t}")
                graph.setdefault(b, {})
    found = cycles(graph)
    assert not found, "package import cycles (each names one import that makes the edge):\n" + "\n".join(found)


def test_no_private_names_across_packages():
    """A package owns its concept and others use its public names: ``from olmax.X.y import _name``
    only inside package X (a module at the root of ``olmax`` is its own package)."""
    found = []
    for m, path in modules().items():
        parts = m.split(".")
        own = parts[1] if len(parts) > 2 or (path.name == "__init__.py" and len(parts) > 1) else None
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("olmax")):
                continue
            target = node.module.split(".")[1] if "." in node.module else None
            found += [f"{m} (line {node.lineno}): from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and (own is None or target != own)]
    assert not found, "private names imported from another package (make them public there):\n" + "\n".join(found)


def test_cli_starts_without_heavy_libraries():
    """Commands import their implementation when they run: ``olmax --help`` (and the parser every
    command builds) loads none of Orbax, Optax, Grain, TensorBoard, torch, transformers, lm-eval."""
    heavy = ("orbax", "optax", "grain", "tensorboardX", "torch", "transformers", "lm_eval", "matplotlib")
    code = ("import sys; from olmax import cli; cli.build_parser(); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", f"building the CLI imported {r.stdout.strip()}"
