"""The ``olmax compare`` report (``olmax.eval.compare`` computes it): the loss and gap plots
(matplotlib's Agg canvas, no pyplot state), and the same sections as Markdown and as one HTML file."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from olmax.eval.alarm import ALARM
from olmax.eval.runs import TRAIN_KEY, Run


def _figure(rows: int = 1, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9, height * rows), dpi=100)
    FigureCanvasAgg(fig)   # Agg canvas without pyplot: no global backend state, no display
    return fig


def _ylim(values: list[np.ndarray]) -> tuple[float, float] | None:
    # Early steps (loss ~ ln V) would flatten everything after; show the range past the first 5%.
    tails = [v[len(v) // 20:] for v in values if len(v)]
    if not tails:
        return None
    allv = np.concatenate(tails)
    lo, hi = float(allv.min()), float(np.quantile(allv, 0.99))
    pad = 0.05 * max(hi - lo, 1e-6)
    return lo - pad, hi + pad


def plot_loss(runs: Sequence[Run], base: Run, base_is_ref: bool, heldout: str | None, path: Path) -> None:
    everyone = [base, *[r for r in runs if r is not base]]
    has_eval = heldout is not None and any(r.evals.get(heldout) for r in everyone)
    fig = _figure(2 if has_eval else 1, 3.6)
    ax = fig.add_subplot(2 if has_eval else 1, 1, 1)
    for r in everyone:
        if len(r.steps):
            ref = r is base and base_is_ref
            ax.plot(r.steps, r.loss, lw=1.6 if ref else 1.0, color="black" if ref else None,
                    ls="--" if ref else "-", label=r.label + (" (reference)" if ref and r.label != "reference" else ""))
    lim = _ylim([r.loss for r in everyone])
    if lim:
        ax.set_ylim(*lim)
    ax.set_ylabel(TRAIN_KEY)
    ax.set_title("training loss")
    if has_eval:
        ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
        for r in everyone:
            pts = r.eval_points(heldout)
            if pts:
                s, v = zip(*pts)
                ref = r is base and base_is_ref
                ax2.plot(s, v, marker="o", ms=4, color="black" if ref else None, ls="--" if ref else "-",
                         label=r.label)
        ax2.set_ylabel(heldout)
        ax2.set_title("held-out loss (identical batches)")
    for a in fig.axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)


def plot_gap(gaps: dict[str, list[dict]], heldout_gaps: dict[str, list[tuple[int, float]]], base_label: str,
             threshold: float, path: Path, alarms: dict[str, dict] | None = None) -> None:
    fig = _figure(1, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axhspan(-threshold, threshold, color="grey", alpha=0.15, label=f"+-{threshold:g} nats")
    for i, (label, bins) in enumerate(gaps.items()):
        color = f"C{i}"
        xs = [(b["start"] + b["end"]) / 2 for b in bins if b["mean"] is not None]
        if xs:
            ax.errorbar(xs, [b["mean"] for b in bins if b["mean"] is not None],
                        yerr=[b["se"] or 0.0 for b in bins if b["mean"] is not None],
                        fmt="o", ms=3, color=color, alpha=0.45, label=f"{label}: train gap per bin (+-SE)")
            ax.plot(xs, [b["smoothed"] for b in bins if b["mean"] is not None], color=color, lw=1.8,
                    label=f"{label}: smoothed")
        hg = heldout_gaps.get(label)
        if hg:
            s, v = zip(*hg)
            ax.plot(s, v, marker="D", ms=6, ls=":", color=color, label=f"{label}: held-out gap")
        first = (alarms or {}).get(label, {}).get("first_fired_step")
        if first is not None:
            ax.axvline(first, color="red", lw=1.2, ls="--", label=f"{label}: memorisation alarm")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss - {base_label} (nats)")
    ax.set_title(f"gap vs {base_label} (negative = better than {base_label})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


# --------------------------------------------------------------------------- Markdown and HTML


def _fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _delta_cell(d: dict | None) -> str:
    if not d:
        return "-"
    return f"{d['delta']:+.4f}" + ("" if d["se"] is None else f" +- {d['se']:.4f}")


def _tables(summary: dict) -> tuple[list[str], list[list[str]]]:
    labels = [summary["baseline"]] + [r["label"] for r in summary["runs"] if r["label"] != summary["baseline"]]
    others = labels[1:]
    headers = ["step", "metric", *labels, *[f"delta {o}" for o in others]]
    rows = []
    for row in summary["milestones"]:
        rows.append([str(row["step"]), row["metric"] + (" (window mean)" if row["metric"] == TRAIN_KEY else ""),
                     *[_fmt(row["values"].get(lb)) for lb in labels],
                     *[_delta_cell(row["deltas"].get(o)) for o in others]])
    return headers, rows


def _sections(summary: dict) -> list[tuple[str, list[tuple[str, Any]]]]:
    """Report content as (title, [(kind, payload)]) shared by the Markdown and HTML writers."""
    base = summary["baseline"]
    runs = [r for r in summary["runs"] if r["label"] != base]
    kind = " (the reference curve)" if summary["baseline_is_reference"] else " (the first run)"
    intro = (f"Baseline: **{base}**" + kind +
             f". Runs: {', '.join(r['label'] for r in runs) or 'none'}. Gap = run - baseline, baseline linearly "
             f"interpolated at the run's steps; bins of {summary['bin_width']} steps, smoothed over "
             f"{summary['smooth']} bins.")
    alarm = [("alert" if a["status"] == ALARM else "p", a["message"]) for a in summary["alarms"].values()]
    alarm = alarm or [("p", "No run to check against a baseline.")]
    gap_rows = []
    for label, g in summary["gaps"].items():
        lb, mb = g["last_bin"], g["min_bin"]
        gap_rows.append([label, str(g["points"]), _fmt(g["mean"]), _fmt(g["se"]),
                         "-" if not lb else f"{lb['mean']:+.4f} ({lb['start']}..{lb['end']})",
                         "-" if not mb else f"{mb['mean']:+.4f} ({mb['start']}..{mb['end']})"])
    headers, rows = _tables(summary)
    ms_note = ("delta +- se: held-out rows use the standard error of the paired per-batch differences when both "
               "runs logged per-batch values (otherwise no se); train rows use the standard error of the mean "
               f"gap over the {summary['bin_width']}-step window ending at the milestone.")
    return [
        ("Run comparison", [("p", intro)]),
        ("Memorisation alarm", alarm),
        ("Loss", [("img", "loss.png")]),
        ("Gap", [("img", "gap.png"),
                 ("table", (["run", "aligned points", "mean gap", "se", "last bin", "lowest bin"], gap_rows))]),
        ("Held-out milestones", [("table", (headers, rows)) if rows else ("p", "No eval/... metrics logged."),
                                 ("p", ms_note)]),
    ]


def write_markdown(summary: dict, path: Path) -> None:
    out = []
    for i, (title, items) in enumerate(_sections(summary)):
        out.append(("# " if i == 0 else "## ") + title + "\n")
        for kind, x in items:
            if kind == "p":
                out.append(x + "\n")
            elif kind == "alert":
                out.append(f"> **{x}**\n")
            elif kind == "img":
                out.append(f"![{x}]({x})\n")
            elif kind == "table":
                h, rows = x
                out.append("| " + " | ".join(h) + " |\n|" + "---|" * len(h))
                out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
                out.append("")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def write_html(summary: dict, path: Path, out_dir: Path) -> None:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>olmax compare</title><style>"
           "body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}.alert{background:#fdd;border:2px solid "
           "#c00;padding:1em;font-weight:bold}img{max-width:100%}</style></head><body>"]
    for i, (title, items) in enumerate(_sections(summary)):
        out.append(f"<h{1 if i == 0 else 2}>{e(title)}</h{1 if i == 0 else 2}>")
        for kind, x in items:
            if kind == "p":
                out.append("<p>" + re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", e(x)) + "</p>")
            elif kind == "alert":
                out.append(f"<div class='alert'>{e(x)}</div>")
            elif kind == "img":
                # Embedded, so the HTML file is the whole report.
                data = base64.b64encode((out_dir / x).read_bytes()).decode()
                out.append(f"<img alt='{e(x)}' src='data:image/png;base64,{data}'>")
            elif kind == "table":
                h, rows = x
                out.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in h) + "</tr>")
                out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
                out.append("</table>")
    out.append("</body></html>")
    path.write_text("\n".join(out), encoding="utf-8")
