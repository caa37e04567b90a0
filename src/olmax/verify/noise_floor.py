"""``olmax verify olmo-core --noise-floor``: training parity judged against the reference's own noise.

At the learning rates real recipes use, fp32 rounding differences grow with the training dynamics
(about x10 every 9 steps at lr 2e-3 on the parity model): two OLMo-core runs that differ only in the
summation order drift far beyond a fixed 1e-4 tolerance. A fixed target can then tell neither a
faithful port from a broken one. This check measures the noise floor instead:

- **reference self-gap**: OLMo-core against OLMo-core with perturbations that keep the
  mathematics: the (per-rank) batch split into micro-batches of 1/2, 1/4 and 1/8 of its size
  (other summation orders of the per-token losses and of the gradients). Per step, the largest
  of the three: one split alone under-estimates the reference's noise at some seeds;
- **olmax self-gap**: the first of those perturbations on olmax (``train.micro_batch_size``);
- **gap**: olmax against the unperturbed OLMo-core run (same data, same initial weights).

All three are |delta CE| per step. The verdict (``within_noise``) compares the gap with the
reference's envelope: with ``W[x](s)`` the maximum of ``x`` over the centred window of steps
``s - WINDOW .. s + WINDOW`` (clipped to the run),

    ratio(s) = W[gap](s) / max(W[reference self-gap](s), FLOOR)

and olmax is within the noise when ``max_s ratio(s) <= NOISE_FACTOR`` (``max_gap_ratio``). The
window smooths the zero crossings of a signed difference; ``FLOOR`` (4 fp32 ulps of a CE between
4 and 8) keeps the ratio finite at the first steps, where another summation order may not move the
loss at all. A missing or non-finite loss on olmax's side makes the ratio infinite.

Why a factor above 1: the gap compares two implementations (XLA vs PyTorch kernels) whose rounding
differs in every operation, the reference self-gap only the order of a few sums; olmax against
itself under the same split is up to 8x OLMo-core's self-gap. A real bug adds a systematic
difference at every step, which the dynamics amplify the same way, so its ratio peaks before the
runs saturate (steps ~15-30 at lr 3e-3 on the parity model), 2 to 4 orders above the floor.

Measured on the parity model at lr 3e-3 (data/init seeds 1-5, 60 and 100 steps; ``max_gap_ratio``):
olmax as it is 1.4-8.6; ``optim.beta2=0.951`` 17-518; ``optim.z_loss=null`` 9.5-353 (above 27
except at seed 5, where the reference's own noise jumps at step 16 and swallows it);
``optim.decay_embeddings=true`` 23-1032; the lr schedule shifted by one step 5.7e3-4.3e4.
``NOISE_FACTOR = 15`` leaves olmax's worst case a margin of 1.7 and catches every planted bug at
every seed but that one. bf16 compute (``model.compute_dtype=bfloat16``, OLMo-core's FSDP mixed
precision) is judged against the bf16 reference's own noise and reported against the fp32 floor.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmax.config import Config, ConfigError
from olmax.extras import require
from olmax.verify import olmo_core as oc

WINDOW = 5            # steps either side of s in the running-max envelope
FLOOR = 2e-6          # absolute |delta CE| below which a difference is not resolved (4 ulps of fp32 at CE 4..8)
NOISE_FACTOR = 15.0   # verdict: max_s ratio(s) <= NOISE_FACTOR (measured margins in the module docstring)
_g = oc._g  # numbers as the strict report prints them
DIVERGENCE = oc.CE_TOLERANCE  # "leaves 1e-4": the step where a |delta CE| first exceeds it


# --------------------------------------------------------------------------- statistics


def ce_gaps(a: oc.Trace, b: oc.Trace, steps: int) -> list[float]:
    """|CE_a - CE_b| at steps 1..``steps``; inf where a step is missing or a loss is not finite."""
    out = []
    for s in range(1, steps + 1):
        x, y = a.ce.get(s), b.ce.get(s)
        ok = x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
        out.append(abs(x - y) if ok else math.inf)
    return out


def envelope(x: list[float], window: int = WINDOW) -> list[float]:
    """Running maximum over the centred window [s - window, s + window] (clipped to the series)."""
    n = len(x)
    return [max(x[max(0, i - window):min(n, i + window + 1)]) for i in range(n)]


def first_above(x: list[float], threshold: float = DIVERGENCE) -> int | None:
    """The first 1-based step where ``x`` exceeds ``threshold`` (None: never)."""
    return next((i + 1 for i, v in enumerate(x) if not v <= threshold), None)


def gap_ratios(gap: list[float], ref_gap: list[float], window: int = WINDOW, floor: float = FLOOR) -> list[float]:
    """ratio(s) = W[gap](s) / max(W[ref_gap](s), floor); inf where either is not finite (a lost or
    NaN loss on either side leaves nothing to judge by: outside the noise, never inside)."""
    return [g / max(r, floor) if math.isfinite(g) and math.isfinite(r) else math.inf
            for g, r in zip(envelope(gap, window), envelope(ref_gap, window))]


def verdict(gap: list[float], ref_gap: list[float], factor: float = NOISE_FACTOR, window: int = WINDOW,
            floor: float = FLOOR) -> dict[str, Any]:
    """The noise-floor verdict of a gap against the reference self-gap (see the module docstring)."""
    ratios = gap_ratios(gap, ref_gap, window, floor)
    worst = max(range(len(ratios)), key=lambda i: ratios[i]) if ratios else None
    max_ratio = ratios[worst] if worst is not None else None
    return {
        "within_noise": max_ratio is not None and max_ratio <= factor,
        "noise_factor": factor,
        "max_gap_ratio": max_ratio,
        "max_gap_ratio_step": None if worst is None else worst + 1,
        "statistic": f"max over steps s of W[gap](s) / max(W[reference self-gap](s), {floor:g}), "
                     f"W = running max of |delta CE| over steps s-{window}..s+{window}",
        "window": window,
        "floor": floor,
    }


def smoothed_milestones(olmax: oc.Trace, ref: oc.Trace, ref_perturbed: list[oc.Trace], steps: int,
                        count: int = 10) -> list[dict[str, Any]]:
    """At ``count`` evenly spaced steps: the mean CE over the window of steps since the previous
    milestone for OLMo-core and olmax, their difference, and the reference's own spread there (the
    largest |difference| between OLMo-core and its micro-batch splits). The smoothed loss curves of a
    long horizon, where per-step values have long decorrelated."""
    width = max(1, steps // count)
    rows = []
    for end in range(width, steps + 1, width):
        window = range(end - width + 1, end + 1)

        def mean(t: oc.Trace) -> float | None:
            v = [t.ce[s] for s in window if s in t.ce]
            return _num(sum(v) / len(v)) if len(v) == width else None
        a, b = mean(ref), mean(olmax)
        splits = [mean(p) for p in ref_perturbed]
        rows.append({"step": end, "window": width, "olmo_core": a, "olmax": b,
                     "delta_olmax": None if a is None or b is None else b - a,
                     "reference_spread": None if a is None or None in splits else max(abs(c - a) for c in splits)})
    return rows


def _num(x: float) -> float | None:
    """JSON-safe: inf/nan become None."""
    return x if math.isfinite(x) else None


def reference_self_gap(ref: oc.Trace, ref_perturbed: list[oc.Trace], steps: int) -> list[float]:
    """Per step, the largest |delta CE| between the reference and any of its perturbed runs."""
    if not ref_perturbed:
        raise ValueError("the noise floor needs at least one perturbed reference run")
    return [max(x) for x in zip(*(ce_gaps(p, ref, steps) for p in ref_perturbed))]


def noise_report(olmax: oc.Trace, ref: oc.Trace, ref_perturbed: list[oc.Trace], olmax_perturbed: oc.Trace | None,
                 steps: int, factor: float = NOISE_FACTOR) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(report, per-step rows) of the noise-floor comparison."""
    gap = ce_gaps(olmax, ref, steps)
    ref_gap = reference_self_gap(ref, ref_perturbed, steps)
    self_gap = ce_gaps(olmax_perturbed, olmax, steps) if olmax_perturbed is not None else None
    v = verdict(gap, ref_gap, factor)
    ratios = gap_ratios(gap, ref_gap)
    env_gap, env_ref = envelope(gap), envelope(ref_gap)
    report = {
        **v,
        "divergence_step": first_above(gap),
        "reference_divergence_step": first_above(ref_gap),
        "olmax_self_divergence_step": None if self_gap is None else first_above(self_gap),
        "divergence_threshold": DIVERGENCE,
        "max_gap": _num(max(gap)) if gap else None,
        "max_reference_self_gap": _num(max(ref_gap)) if ref_gap else None,
        "max_olmax_self_gap": None if not self_gap else _num(max(self_gap)),
        # The olmax self-gap judged the same way: a check that olmax's own noise is the reference's kind.
        "olmax_self_gap_ratio": None if not self_gap else _num(max(gap_ratios(self_gap, ref_gap))),
        # The strict per-step parity check (ids, lr, grad norm, skip decisions; CE at 1e-4) for reference.
        "parity": oc.compare(olmax, ref, steps),
        "milestones": smoothed_milestones(olmax, ref, ref_perturbed, steps),
    }
    rows = []
    for s in range(1, steps + 1):
        i = s - 1
        rows.append({
            "step": s, "ce_olmax": olmax.ce.get(s), "ce_olmo_core": ref.ce.get(s),
            "gap": _num(gap[i]), "reference_self_gap": _num(ref_gap[i]),
            "olmax_self_gap": None if self_gap is None else _num(self_gap[i]),
            "gap_envelope": _num(env_gap[i]), "reference_envelope": _num(env_ref[i]), "ratio": _num(ratios[i]),
        })
    return report, rows


# --------------------------------------------------------------------------- runs


def perturbed_micro_batches(cfg: Config, world: int = 1) -> list[int]:
    """The maths-preserving perturbations: micro-batches of 1/2, 1/4 and 1/8 of the run's per-device
    (per-rank) micro-batch, as far as they divide it (at least the half), i.e. other summation
    orders of the losses and gradients."""
    if cfg.train.global_batch_size % world:
        raise ConfigError(f"--ranks {world} must divide train.global_batch_size={cfg.train.global_batch_size}")
    mb = cfg.train.micro_batch_size or cfg.train.global_batch_size // world
    if mb < 2 or mb % 2:
        raise ConfigError(f"--noise-floor splits the micro-batch in two: train.micro_batch_size (or the per-rank "
                          f"batch) must be even, got {mb}")
    return [mb // k for k in (2, 4, 8) if mb % k == 0]


@dataclass(frozen=True)
class Recipe:
    """What both sides train: ``parity_config(steps, seed, overrides)`` (rebuilt in child processes)."""

    steps: int
    seed: int | None = None
    overrides: tuple[str, ...] = ()

    def config(self, extra: list[str] | tuple[str, ...] = ()) -> Config:
        return oc.parity_config(self.steps, self.seed, [*self.overrides, *extra])


def _spawn(specs: list[dict[str, Any]], spec_dir: Path, env: dict[str, str]) -> list[oc.Trace]:
    """Run ``olmax.verify._worker`` once per spec, concurrently; their traces."""
    spec_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, spec in enumerate(specs):
        f, log_path = spec_dir / f"spec{i}.json", spec_dir / f"worker{i}.log"
        f.write_text(json.dumps(spec))
        with open(log_path, "w", encoding="utf-8") as log:
            p = subprocess.Popen([sys.executable, "-m", "olmax.verify._worker", str(f)], env={**os.environ, **env},
                                 stdout=log, stderr=subprocess.STDOUT)
        procs.append((f, log_path, p))
    # One rank failing leaves the others blocked in a collective: stop them (our own children).
    while any(p.poll() is None for _, _, p in procs):
        if any(p.returncode not in (None, 0) for _, _, p in procs):
            for _, _, p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    failed = []
    for f, log_path, p in procs:
        if p.wait() != 0:
            failed.append(f"{f.name}: exit {p.returncode}; the end of {log_path}:\n{log_path.read_text()[-2000:]}")
    if failed:
        raise RuntimeError("a verify worker failed: " + "\n".join(failed))
    return [oc.trace_from_json(json.loads(f.with_suffix(".trace.json").read_text())) for f, _, _ in procs]


def run_olmo_core_ranks(recipe: Recipe, extra: list[str], paths: list[str], work: Path, hf_dir: Path | None,
                        world: int) -> oc.Trace:
    """OLMo-core on ``world`` processes (gloo, HSDP as the official script wraps it); the trace of
    rank 0 with each step's ids merged back into global order (rank r holds columns r::world)."""
    work.mkdir(parents=True, exist_ok=True)
    store = work / "torch_dist_store"
    store.unlink(missing_ok=True)
    base = {"side": "olmo_core", "steps": recipe.steps, "seed": recipe.seed, "overrides": [*recipe.overrides, *extra],
            "olmax_overrides": [], "paths": paths, "out": str(work), "work": str(work),
            "hf_dir": None if hf_dir is None else str(hf_dir), "world": world, "store": str(store)}
    t0 = time.perf_counter()
    traces = _spawn([{**base, "rank": r} for r in range(world)], work / "workers", {"OMP_NUM_THREADS": "1"})
    t = traces[0]
    for s in t.ids:
        shares = [tr.ids.get(s, []) for tr in traces]
        merged: list[int] = [0] * sum(len(x) for x in shares)
        for r, share in enumerate(shares):
            merged[r::world] = share
        t.ids[s] = merged
    t.seconds = time.perf_counter() - t0
    return t


def run_olmax_devices(recipe: Recipe, olmax_overrides: list[str] | tuple[str, ...], out: Path, paths: list[str],
                      hf_dir: Path, run_dir: Path, devices: int) -> oc.Trace:
    """olmax in a child process with ``devices`` CPU devices (the default mesh shards the batch
    and the parameters over all of them)."""
    spec = {"side": "olmax", "steps": recipe.steps, "seed": recipe.seed, "overrides": list(recipe.overrides),
            "olmax_overrides": list(olmax_overrides), "paths": paths, "out": str(out), "work": str(run_dir),
            "hf_dir": str(hf_dir)}
    t0 = time.perf_counter()
    (t,) = _spawn([spec], run_dir.parent / f"{run_dir.name}_worker",
                  {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    t.seconds = time.perf_counter() - t0
    return t


@dataclass
class NoiseFloor:
    """The four runs of a noise-floor check, kept so that more olmax variants can be judged against
    the same reference runs (``run_olmax`` then ``judge``)."""

    recipe: Recipe
    world: int
    out: Path
    paths: list[str]
    hf_dir: Path
    ref: oc.Trace
    ref_perturbed: list[oc.Trace]
    olmax: oc.Trace
    olmax_perturbed: oc.Trace
    seconds: dict[str, float] = field(default_factory=dict)
    # bf16 compute only: OLMo-core in fp32 and its micro-batch splits (the fp32 noise floor).
    fp32_ref: oc.Trace | None = None
    fp32_ref_perturbed: list[oc.Trace] = field(default_factory=list)

    def run_olmax(self, olmax_overrides: list[str] | tuple[str, ...], name: str) -> oc.Trace:
        """Train olmax from OLMo-core's initial weights with ``olmax_overrides`` into ``out/name``."""
        if self.world == 1:
            return oc.run_olmax(oc.olmax_config(self.recipe.config(), self.out, self.paths, self.hf_dir,
                                                olmax_overrides), self.out / name)
        return run_olmax_devices(self.recipe, olmax_overrides, self.out, self.paths, self.hf_dir, self.out / name,
                                 self.world)

    def judge(self, olmax: oc.Trace | None = None, factor: float = NOISE_FACTOR) -> tuple[dict[str, Any], list]:
        """Noise-floor report of ``olmax`` (default: this check's own olmax run)."""
        olmax = self.olmax if olmax is None else olmax
        report, rows = noise_report(olmax, self.ref, self.ref_perturbed, self.olmax_perturbed, self.recipe.steps,
                                    factor)
        if self.fp32_ref is not None:
            n = self.recipe.steps
            gap, fp32_gap = ce_gaps(olmax, self.ref, n), reference_self_gap(self.fp32_ref, self.fp32_ref_perturbed, n)
            report["fp32_floor"] = {
                "max_gap_ratio": _num(max(gap_ratios(gap, fp32_gap))),
                "within_factor": max(gap_ratios(gap, fp32_gap)) <= factor,
                "reference_divergence_step": first_above(fp32_gap),
                "max_reference_self_gap": _num(max(fp32_gap)),
            }
            for row, g in zip(rows, fp32_gap):
                row["fp32_reference_self_gap"] = _num(g)
        return report, rows


def measure(recipe: Recipe, out: Path, olmax_overrides: list[str] | tuple[str, ...] = (), log: Any = sys.stderr,
            world: int = 1) -> NoiseFloor:
    """Run OLMo-core, OLMo-core perturbed, olmax (with ``olmax_overrides``) and olmax perturbed (the
    same overrides plus the perturbation) into ``out``; ``world`` OLMo-core ranks and olmax devices."""
    out = Path(out)
    cfg = recipe.config()
    mbs = perturbed_micro_batches(cfg, world)
    pert = [f"train.micro_batch_size={mbs[0]}"]
    paths = oc.corpus(out / "tokens", cfg)
    hf_dir = out / "olmo_core_init_hf"
    where = "1 process" if world == 1 else f"{world} ranks (gloo, HSDP) / olmax on {world} devices"
    _say(log, f"OLMo-core: {cfg.train.steps} steps of {cfg.train.global_batch_size} x {cfg.data.sequence_length} "
              f"tokens, lr {cfg.optim.lr:g}, {where}")

    def reference(extra: list[str], work: Path, hf: Path | None = None) -> oc.Trace:
        return (oc.run_olmo_core_here(recipe.config(extra), paths, work, hf) if world == 1 else
                run_olmo_core_ranks(recipe, extra, paths, work, hf, world))

    ref = reference([], out / "olmo_core", hf_dir)
    write_metrics(ref, out / "olmo_core" / "metrics.jsonl")

    def reference_splits(dtype_extra: list[str], prefix: str) -> list[oc.Trace]:
        traces = []
        for mb in mbs:
            _say(log, f"OLMo-core again, micro-batches of {mb} per rank (the reference's noise floor)")
            extra = [*dtype_extra, f"train.micro_batch_size={mb}"]
            work = out / f"{prefix}{mb}"
            traces.append(reference(extra, work))
            write_metrics(traces[-1], work / "metrics.jsonl")
        return traces

    ref_p = reference_splits([], "olmo_core_micro")
    nf = NoiseFloor(recipe, world, out, paths, hf_dir, ref, ref_p, oc.Trace(), oc.Trace())
    if cfg.model.compute_dtype != "float32":
        # bf16 compute: the verdict uses the bf16 reference's own noise; the fp32 floor is reported too.
        _say(log, "OLMo-core in fp32 (the fp32 noise floor, reported next to the bf16 verdict)")
        fp32 = ["model.compute_dtype=float32"]
        nf.fp32_ref = reference(fp32, out / "olmo_core_fp32")
        nf.fp32_ref_perturbed = reference_splits(fp32, "olmo_core_fp32_micro")
    _say(log, "olmax from OLMo-core's initial weights" +
         (f" (olmax-only overrides: {' '.join(olmax_overrides)})" if olmax_overrides else ""))
    nf.olmax = nf.run_olmax(list(olmax_overrides), "olmax_run")
    _say(log, f"olmax again, micro-batches of {mbs[0]} per device")
    nf.olmax_perturbed = nf.run_olmax([*olmax_overrides, *pert], "olmax_run_perturbed")
    runs = [("olmo_core", ref), *((f"olmo_core_micro{mb}", t) for mb, t in zip(mbs, ref_p)),
            ("olmax", nf.olmax), (f"olmax_micro{mbs[0]}", nf.olmax_perturbed)]
    nf.seconds = {k: round(t.seconds, 2) for k, t in runs}
    return nf


def write_metrics(trace: oc.Trace, path: Path) -> None:
    """A trace as an olmax-style ``metrics.jsonl`` (OLMo-core's metric names), so that
    ``olmax compare`` reads OLMo-core's runs like olmax's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for s in sorted(trace.ce):
            row = {"step": s}
            for name, series in oc._metric_series(trace):
                if s in series:
                    row[name] = series[s]
            f.write(json.dumps(row) + "\n")


def plots(out: Path, compare_out: Path | None = None) -> dict[str, Any]:
    """``olmax compare`` of a noise-floor folder: OLMo-core (the baseline), olmax, and OLMo-core with
    the micro-batch split (the reference's own noise) into ``out/compare``; its summary."""
    from olmax.eval.compare import compare
    micro = sorted(out.glob("olmo_core_micro*/metrics.jsonl"),
                   key=lambda p: -int(p.parent.name[len("olmo_core_micro"):]))
    paths = [str(out / "olmo_core" / "metrics.jsonl"), str(out / "olmax_run" / "metrics.jsonl"),
             *[str(p) for p in micro[:1]]]
    labels = ["OLMo-core", "olmax", *[f"OLMo-core, micro-batch {p.parent.name[len('olmo_core_micro'):]}"
                                      for p in micro[:1]]]
    return compare(paths, labels=labels, out=compare_out or out / "compare")


def _say(log: Any, msg: str) -> None:
    oc._say(log, msg, tag="verify olmo-core --noise-floor")


def run_noise_floor(steps: int = 100, seed: int | None = None, overrides: list[str] | tuple[str, ...] = (),
                    olmax_overrides: list[str] | tuple[str, ...] = (), out: str | os.PathLike | None = None,
                    log: Any = sys.stderr, factor: float = NOISE_FACTOR, world: int = 1,
                    with_plots: bool = False) -> dict[str, Any]:
    """The ``--noise-floor`` check. ``out`` keeps the runs (OLMo-core's with a ``metrics.jsonl``),
    ``report.json`` and ``steps.jsonl`` (new or empty folder); None: a temporary folder, removed
    after. ``with_plots``: also ``olmax compare`` them into ``out/compare`` (needs ``out``)."""
    require("verify", "torch", "olmo_core")  # before either side trains
    if with_plots:
        require("plots", "matplotlib")
    if with_plots and out is None:
        raise ConfigError("--plots needs --out (the plots are written there)")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if world < 1:
        raise ConfigError(f"--ranks must be >= 1, got {world}")
    recipe = Recipe(steps, seed, tuple(overrides))
    perturbed_micro_batches(recipe.config(), world)  # refuse before running anything
    return oc.in_out_dir(out, "olmax-verify-noise-floor-",
                         lambda d: _run(recipe, olmax_overrides, d, log, factor, world, with_plots))


def _run(recipe: Recipe, olmax_overrides, out: Path, log: Any, factor: float, world: int,
         with_plots: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    nf = measure(recipe, out, olmax_overrides, log, world)
    cfg = recipe.config()
    report, rows = nf.judge(factor=factor)
    report["steps"] = cfg.train.steps
    report["lr"] = cfg.optim.lr
    report["ranks"] = world
    report["compute_dtype"] = cfg.model.compute_dtype
    mbs = perturbed_micro_batches(cfg, world)
    unit = "per rank/device" if world > 1 else "per process"
    report["perturbation"] = (f"OLMo-core: train.micro_batch_size in {mbs} ({unit}); "
                              f"olmax: train.micro_batch_size={mbs[0]}")
    report["olmax_overrides"] = list(olmax_overrides)
    report["seconds"] = {**nf.seconds, "total": round(time.perf_counter() - t0, 2)}
    if with_plots:
        summary = plots(out)
        report["plots"] = {k: summary["files"][k] for k in ("loss_png", "gap_png", "report_md", "report_html")}
    report = _json_safe(report)
    oc.write_report(out, report, rows)
    return report


def _json_safe(x: Any) -> Any:
    """Non-finite floats (an infinite ratio: a NaN loss) become None, for strict JSON readers."""
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"olmax vs OLMo-core against OLMo-core's own noise, {r['steps']} steps at lr {r['lr']:g}, "
        f"{r['ranks']} rank(s): "
        f"{'WITHIN NOISE' if r['within_noise'] else 'OUTSIDE THE NOISE'}",
        f"  max gap ratio         {_g(r['max_gap_ratio'])} at step {r['max_gap_ratio_step']} "
        f"(within noise when <= {r['noise_factor']:g})",
        f"  statistic             {r['statistic']}",
        f"  perturbation          {r['perturbation']}",
        f"  |dCE| > {r['divergence_threshold']:g} from step  olmax vs OLMo-core {r['divergence_step']}, "
        f"OLMo-core vs itself {r['reference_divergence_step']}, olmax vs itself {r['olmax_self_divergence_step']}",
        f"  max |dCE|             olmax vs OLMo-core {_g(r['max_gap'])}, OLMo-core vs itself "
        f"{_g(r['max_reference_self_gap'])}, olmax vs itself {_g(r['max_olmax_self_gap'])}",
        f"  olmax self-gap ratio  {_g(r['olmax_self_gap_ratio'])}",
        f"  strict parity         "
        f"{'OK' if r['parity']['ok'] else 'first difference ' + str(r['parity']['first_difference'])}",
    ]
    ms = [m for m in r.get("milestones", []) if m["delta_olmax"] is not None and m["reference_spread"] is not None]
    if ms:
        lines.append(f"  smoothed CE ({ms[0]['window']}-step windows)  max |olmax - OLMo-core| "
                     f"{_g(max(abs(m['delta_olmax']) for m in ms))}, max |OLMo-core split - OLMo-core| "
                     f"{_g(max(m['reference_spread'] for m in ms))}")
    fp = r.get("fp32_floor")
    if fp:
        lines.append(f"  against fp32 floor    gap ratio {_g(fp['max_gap_ratio'])} (OLMo-core fp32 self-gap leaves "
                     f"{r['divergence_threshold']:g} at step {fp['reference_divergence_step']}, max "
                     f"{_g(fp['max_reference_self_gap'])})")
    if r.get("plots"):
        lines.append(f"  plots                 {r['plots']['loss_png']}, {r['plots']['gap_png']}, "
                     f"{r['plots']['report_md']}")
    if r.get("seconds"):
        lines.append("  seconds               " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()))
    return "\n".join(lines)
