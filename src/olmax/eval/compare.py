"""Compare runs with each other or with a reference curve: gaps, milestone table, alarm, summary.

Inputs (``olmax.eval.runs.read_runs``):

- an olmax run directory or its ``metrics.jsonl`` (training loss ``train/CE loss``; every
  numeric ``eval/...`` key is a held-out metric; ``M [batch i]`` keys are M's per-batch values);
- a TSV with a header holding a step column (``step``, ``_step``, ``Step``, ``global_step``) and a
  loss column (``loss``, or a name containing ``CE loss`` or ``train/loss``), or headerless
  ``step<TAB>loss`` lines;
- an exported W&B CSV (``_step`` or ``Step`` column; loss column as above; W&B's ``__MIN`` /
  ``__MAX`` columns ignored; several runs in one export, ``RUN - train/CE loss``, become several
  runs labelled ``RUN``).

Alignment: a run's gap at its logged step s is ``loss(s) - baseline(s)``, the baseline (the
``--reference`` if given, else the first run) linearly interpolated at s inside its own step
range (exact where both logged s; never extrapolated). Gaps are binned on shared equal-width
step bins (``bins`` per comparison) and smoothed with a centred moving average over ``smooth``
bins, as the published figure.

Milestone table: one row per (step, metric) where any run logged an ``eval/...`` metric, values
side by side, ``delta = run - baseline`` at the same step (exact step match; held-out batches are
identical for both runs). Uncertainty ``se``:

- ``paired per-batch``: both runs logged per-batch values (``HeldoutEvaluator(per_batch=True)``):
  standard error of the mean of the per-batch differences (std ddof=1 / sqrt(n));
- otherwise none (a single aggregate per run has no spread).

A ``train/CE loss`` row at each milestone gives the mean training gap over the window
``(step - bin_width, step]`` with the standard error of that mean (``se_method: window``).

Outputs in ``out`` (``olmax.eval.report``): ``loss.png``, ``gap.png``, ``report.md``, ``report.html``
(PNGs embedded as data URIs) and ``summary.json``; the summary is also what ``olmax compare --json`` prints::

    {"baseline": LABEL, "baseline_is_reference": bool,
     "runs": [{"label", "source", "train_points", "first_step", "last_step", "eval_metrics"}],
     "bin_width": int, "smooth": int, "heldout_metric": str | null,
     "gaps": {LABEL: {"points", "mean", "se", "last_bin": {...} | null, "min_bin": {...} | null,
                      "bins": [{"start", "end", "n", "mean", "se", "smoothed"}]}},
     "milestones": [{"step", "metric", "values": {LABEL: float | null},
                     "deltas": {LABEL: {"delta", "se", "se_method"}}}],
     "alarms": {LABEL: AlarmResult.to_dict()},     # olmax.eval.alarm
     "files": {"loss_png", "gap_png", "report_md", "report_html", "summary_json"}}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from olmax import jsonout
from olmax.eval.alarm import AlarmConfig, AlarmResult, check_memorisation
from olmax.eval.report import plot_gap, plot_loss, write_html, write_markdown
from olmax.eval.runs import HELDOUT_KEY, TRAIN_KEY, Run, mean_se, read_run, read_runs
from olmax.extras import require


def gap(run: Run, base: Run) -> tuple[np.ndarray, np.ndarray]:
    """(steps, run - baseline) at the run's steps inside the baseline's range (interpolated)."""
    if len(run.steps) == 0 or len(base.steps) == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    inside = (run.steps >= base.steps[0]) & (run.steps <= base.steps[-1])
    s = run.steps[inside]
    return s, run.loss[inside] - np.interp(s, base.steps, base.loss)


def bin_edges(lo: int, hi: int, bins: int) -> tuple[np.ndarray, int]:
    """Equal-width integer bins ``(start, end]`` covering ``lo..hi``."""
    width = max(1, math.ceil((hi - lo + 1) / max(1, bins)))
    return lo - 1 + width * np.arange(math.ceil((hi - lo + 1) / width) + 1), width


def bin_gap(steps: np.ndarray, gaps: np.ndarray, edges: np.ndarray, smooth: int = 5) -> list[dict[str, Any]]:
    """Mean, standard error and count per bin ``(start, end]``, plus a centred moving average."""
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        g = gaps[(steps > a) & (steps <= b)]
        mean, se = mean_se(g)
        out.append({"start": int(a) + 1, "end": int(b), "n": int(len(g)), "mean": mean, "se": se})
    means = np.array([np.nan if r["mean"] is None else r["mean"] for r in out])
    h = max(0, smooth) // 2
    for i, r in enumerate(out):
        w = means[max(0, i - h): i + h + 1]
        w = w[~np.isnan(w)]
        r["smoothed"] = float(w.mean()) if len(w) and r["mean"] is not None else None
    return out


def window_gap(steps: np.ndarray, gaps: np.ndarray, end: int, width: int) -> tuple[float | None, float | None, int]:
    """Mean gap over ``(end - width, end]``, its standard error and the count."""
    g = gaps[(steps > end - width) & (steps <= end)]
    return (*mean_se(g), int(len(g)))


def paired_delta(a: Sequence[float], b: Sequence[float]) -> tuple[float, float | None]:
    """Mean of per-batch differences a_i - b_i and its standard error (identical batches)."""
    return mean_se(np.asarray(a, np.float64) - np.asarray(b, np.float64))  # type: ignore[return-value]


def milestone_table(runs: Sequence[Run], base: Run, width: int) -> list[dict[str, Any]]:
    """Rows of held-out metrics at eval steps, with deltas against ``base`` (module docstring)."""
    everyone = [base, *[r for r in runs if r is not base]]
    metrics = sorted({m for r in everyone for m in r.evals})
    steps = sorted({s for r in everyone for m in r.evals.values() for s in m})
    rows = []
    for step in steps:
        # Training gap at the milestone, so held-out deltas can be read against it.
        tr = {"step": step, "metric": TRAIN_KEY, "values": {}, "deltas": {}}
        for r in everyone:
            m, _, n = window_gap(r.steps, r.loss, step, width) if len(r.steps) else (None, None, 0)
            tr["values"][r.label] = m
            if r is not base:
                g, se, n = window_gap(*gap(r, base), step, width)
                if g is not None:
                    tr["deltas"][r.label] = {"delta": g, "se": se, "se_method": "window"}
        if tr["deltas"]:
            rows.append(tr)
        for metric in metrics:
            values = {r.label: r.evals.get(metric, {}).get(step) for r in everyone}
            if all(v is None for v in values.values()):
                continue
            deltas = {}
            b = values[base.label]
            for r in everyone[1:]:
                v = values[r.label]
                if v is None or b is None:
                    continue
                se, method = None, None
                pa, pb = r.per_batch.get(metric, {}).get(step), base.per_batch.get(metric, {}).get(step)
                if pa and pb and len(pa) == len(pb):
                    _, se = paired_delta(pa, pb)
                    method = "paired per-batch"
                deltas[r.label] = {"delta": v - b, "se": se, "se_method": method}
            rows.append({"step": step, "metric": metric, "values": values, "deltas": deltas})
    return rows


def pick_heldout_metric(runs: Sequence[Run], base: Run, metric: str | None = None) -> str | None:
    """``metric`` if given, else ``eval/heldout/CE loss``, else the first ``eval/.../CE loss`` the
    baseline and a run both logged."""
    if metric:
        return metric
    common = set(base.evals) & {m for r in runs if r is not base for m in r.evals}
    if HELDOUT_KEY in common:
        return HELDOUT_KEY
    cands = sorted(m for m in common if m.endswith("CE loss"))
    return cands[0] if cands else None


# --------------------------------------------------------------------------- driver


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for lb in labels:
        seen[lb] = seen.get(lb, 0) + 1
        out.append(lb if seen[lb] == 1 else f"{lb}#{seen[lb]}")
    return out


def load_inputs(paths: Sequence[str], reference: str | None = None, labels: Sequence[str] | None = None,
                reference_label: str = "reference") -> tuple[list[Run], Run | None]:
    if not paths:
        raise ValueError("give at least one run or metrics file to compare")
    if labels and len(labels) != len(paths):
        raise ValueError(f"--labels: {len(labels)} labels for {len(paths)} inputs")
    runs: list[Run] = []
    for i, p in enumerate(paths):
        runs += read_runs(p, labels[i] if labels else None)
    ref = read_run(reference, reference_label) if reference else None
    names = _unique([r.label for r in runs] + ([ref.label] if ref else []))
    for r, n in zip(runs + ([ref] if ref else []), names):
        r.label = n
    return runs, ref


def compare(paths: Sequence[str], reference: str | None = None, *, labels: Sequence[str] | None = None,
            out: str | Path = "compare-report", bins: int = 50, smooth: int = 5,
            alarm: AlarmConfig = AlarmConfig(), heldout_metric: str | None = None,
            reference_label: str = "reference") -> dict[str, Any]:
    """Read, align, plot and report; returns the summary (keys in the module docstring)."""
    require("plots", "matplotlib")
    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        # Reports never overwrite (like convert and tokenize): an earlier report may be the one cited.
        raise ValueError(f"output directory {str(out)!r} already exists and is not empty; choose another --out")
    runs, ref = load_inputs(paths, reference, labels, reference_label)
    base = ref or runs[0]
    if len(base.steps) == 0:
        raise ValueError(f"{base.source}: the baseline has no training loss to compare against")
    others = [r for r in runs if r is not base]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    all_steps = np.concatenate([r.steps for r in [base, *others] if len(r.steps)])
    edges, width = bin_edges(int(all_steps.min()), int(all_steps.max()), bins)
    window = alarm.window or width
    held = pick_heldout_metric(others, base, heldout_metric)

    gaps, bins_by_run, held_gaps, alarms = {}, {}, {}, {}
    for r in others:
        s, g = gap(r, base)
        b = bin_gap(s, g, edges, smooth)
        filled = [x for x in b if x["mean"] is not None]
        mean, se = mean_se(g)
        gaps[r.label] = {"points": int(len(g)), "mean": mean, "se": se, "last_bin": filled[-1] if filled else None,
                         "min_bin": min(filled, key=lambda x: x["mean"]) if filled else None, "bins": b}
        bins_by_run[r.label] = b
        if held:
            bh = base.evals.get(held, {})
            held_gaps[r.label] = [(st, v - bh[st]) for st, v in r.eval_points(held) if st in bh]
        res: AlarmResult = check_memorisation(r.train_points(), base.train_points(), r.eval_points(held),
                                              base.eval_points(held), alarm, label=r.label, reference=base.label,
                                              window=window)
        alarms[r.label] = res.to_dict()

    files = {"loss_png": str(out_dir / "loss.png"), "gap_png": str(out_dir / "gap.png"),
             "report_md": str(out_dir / "report.md"), "report_html": str(out_dir / "report.html"),
             "summary_json": str(out_dir / "summary.json")}
    summary = {
        "baseline": base.label, "baseline_is_reference": ref is not None,
        "runs": [{"label": r.label, "source": r.source, "train_points": int(len(r.steps)),
                  "first_step": int(r.steps[0]) if len(r.steps) else None,
                  "last_step": int(r.steps[-1]) if len(r.steps) else None,
                  "eval_metrics": sorted(r.evals)} for r in [*runs, *([ref] if ref else [])]],
        "bin_width": int(width), "smooth": int(smooth), "heldout_metric": held,
        "gaps": gaps, "milestones": milestone_table(others, base, window), "alarms": alarms, "files": files,
    }
    plot_loss(others, base, ref is not None, held, out_dir / "loss.png")
    plot_gap(bins_by_run, held_gaps, base.label, alarm.threshold, out_dir / "gap.png", alarms)
    write_markdown(summary, out_dir / "report.md")
    write_html(summary, out_dir / "report.html", out_dir)
    (out_dir / "summary.json").write_text(jsonout.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
