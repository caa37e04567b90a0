"""Resume A/B: an uninterrupted run against the same run interrupted and resumed in a new process.

Run A trains ``steps`` updates in one process. Run B trains ``interrupt_at`` updates, stops
(after writing checkpoint ``interrupt_at``), and a fresh process resumes it to ``steps``. Every
logged step's CE loss, z-loss, grad norm, lr and skip flag must be identical bit for bit (the
published reproduction's bar: difference 0.000 on every compared step). With different device
counts before and after the interruption (elastic), the losses must agree within ``tol``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from olmax import jsonout
from olmax.argtypes import int_in, nonneg_float, positive_int
from olmax.eval.runs import read_metrics
from olmax.recipes import add_recipe_args

COMPARED = ("train/CE loss", "train/Z loss", "optim/total grad norm", "optim/LR (group 0)", "optim/step skipped")


def _train(recipe: str, run_dir: Path, overrides: list[str], devices: int | None, max_steps: int | None) -> None:
    cmd = [sys.executable, "-m", "olmax.cli", "train", recipe, "--run-dir", str(run_dir), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    if max_steps is not None:
        cmd += ["--max-steps-this-run", str(max_steps)]
    env = dict(os.environ)
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode == 2:  # the trainer refused its input: a user error, its own one line
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        raise ValueError(f"the training run in {run_dir} refused: {lines[-1][7:] if lines else r.stderr[-500:]}")
    if r.returncode != 0:
        raise RuntimeError(f"training subprocess failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")


def compare(a: dict[int, dict], b: dict[int, dict], tol: float = 0.0) -> dict:
    steps = sorted(set(a) | set(b))
    missing = [s for s in steps if s not in a or s not in b]
    first, max_diff = None, 0.0
    for s in steps:
        if s in missing:
            continue
        for k in COMPARED:
            if k not in a[s] and k not in b[s]:
                continue
            d = abs(float(a[s][k]) - float(b[s][k]))
            max_diff = max(max_diff, d) if k == "train/CE loss" else max_diff
            if d > tol and first is None:
                first = {"step": s, "metric": k, "uninterrupted": a[s][k], "resumed": b[s][k]}
    return {"steps": len(steps) - len(missing), "missing_steps": missing, "max_abs_ce_diff": max_diff,
            "first_difference": first, "ok": first is None and not missing}


def verify_resume(recipe: str, overrides: list[str], steps: int, interrupt_at: int, workdir: Path,
                  devices_before: int | None = None, devices_after: int | None = None, tol: float = 0.0) -> dict:
    if steps < 2:
        raise ValueError(f"--steps must be >= 2 (steps before and after the interruption), got {steps}")
    if not 0 < interrupt_at < steps:
        raise ValueError(f"--interrupt-at must be in 1..{steps - 1}, got {interrupt_at}")
    _check_devices(recipe, overrides, devices_before, devices_after)
    ov = list(overrides) + [f"train.steps={steps}", "train.log_interval=1"]
    a, b = workdir / "uninterrupted", workdir / "resumed"
    _train(recipe, a, ov, devices_before, None)
    _train(recipe, b, ov, devices_before, interrupt_at)
    _train(recipe, b, ov, devices_after or devices_before, None)
    res = compare(read_metrics(a), read_metrics(b), tol)
    res.update({"interrupt_at": interrupt_at, "total_steps": steps, "tolerance": tol,
                "devices_before": devices_before, "devices_after": devices_after or devices_before})
    return res


def _check_devices(recipe: str, overrides: list[str], *counts: int | None) -> None:
    """Refuse, before any training, device counts the run's mesh and batch cannot use (instead of a
    traceback after half the work)."""
    from olmax.config import ConfigError
    from olmax.recipes import get_recipe
    from olmax.sharding import mesh_shape, plan_batch
    cfg = get_recipe(recipe, overrides)
    for flag, n in zip(("--devices-before", "--devices-after"), counts):
        if n is None:
            continue
        try:
            plan_batch(cfg.train.global_batch_size, mesh_shape(cfg.mesh, n), cfg.train.micro_batch_size,
                       cfg.train.max_micro_batch_size)
        except ConfigError as e:
            raise ConfigError(f"{flag} {n}: {e}") from None


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("resume", help="A/B: uninterrupted run vs interrupted + resumed in a new process")
    add_recipe_args(p)
    p.add_argument("--steps", type=int_in(2, 2**31), default=20, help="updates of each run (default 20)")
    p.add_argument("--interrupt-at", type=positive_int, default=None, help="default: steps // 2")
    p.add_argument("--devices-before", type=positive_int, default=None, help="fake CPU devices before the interruption")
    p.add_argument("--devices-after", type=positive_int, default=None,
                   help="fake CPU devices after it (elastic resume)")
    p.add_argument("--tol", type=nonneg_float, default=None,
                   help="default: 0 (bitwise); 1e-5 when the device count changes")
    p.add_argument("--out", default=None, help="keep both run directories here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    p.set_defaults(func=cmd_resume)
    return p


def cmd_resume(args: argparse.Namespace) -> int:
    elastic = args.devices_after is not None and args.devices_after != args.devices_before
    tol = args.tol if args.tol is not None else (1e-5 if elastic else 0.0)
    interrupt = args.steps // 2 if args.interrupt_at is None else args.interrupt_at
    ctx = tempfile.TemporaryDirectory() if args.out is None else None
    work = Path(args.out or ctx.name)
    try:
        res = verify_resume(args.recipe, args.overrides, args.steps, interrupt, work, args.devices_before,
                            args.devices_after, tol)
    finally:
        if ctx:
            ctx.cleanup()
    if args.json:
        print(jsonout.dumps(res, indent=2))
    else:
        status = "IDENTICAL" if res["ok"] and tol == 0 else ("OK" if res["ok"] else "DIFFERENT")
        print(f"resume A/B: {status} over {res['steps']} steps (interrupted at {interrupt}); "
              f"max |delta CE| = {res['max_abs_ce_diff']:.3g} (tolerance {tol:g})")
        if res["first_difference"]:
            print(f"first difference: {res['first_difference']}")
        if res["missing_steps"]:
            print(f"steps missing from one run: {res['missing_steps'][:10]}")
    return 0 if res["ok"] else 1
