"""Runs as the comparison tools read them: olmax run directories and ``metrics.jsonl``, TSV and
W&B CSV exports, each parsed into a :class:`Run` of per-step training loss and other metrics.
Used by ``olmax compare``, the memorisation alarm's reference curve and the ``verify`` checks
(``metric_rows`` is the one ``metrics.jsonl`` parser), with ``mean_se``, the one standard error.

Names are OLMo-core's: the MaxText reproduction's own names for two of its metrics
(``MAXTEXT_NAMES``) are read under OLMo-core's, so its runs compare with olmax's."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TRAIN_KEY = "train/CE loss"
HELDOUT_KEY = "eval/heldout/CE loss"
STEP_COLUMNS = ("step", "_step", "Step", "global_step", "trainer/global_step")
_PER_BATCH = re.compile(r"^(.*) \[batch (\d+)\]$")
_WANDB_SUFFIX = ("__MIN", "__MAX", "__min", "__max")
# The TensorBoard tags the MaxText reproduction added for OLMo-core metrics (spec section 3).
MAXTEXT_NAMES = {"optim/step_skipped": "optim/step skipped", "perf/total_tokens": "throughput/total tokens"}


@dataclass
class Run:
    label: str
    source: str
    steps: np.ndarray                                     # int64, sorted, unique
    loss: np.ndarray                                      # float64, training CE loss
    evals: dict[str, dict[int, float]] = field(default_factory=dict)
    per_batch: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def train_points(self) -> list[tuple[int, float]]:
        return [(int(s), float(v)) for s, v in zip(self.steps, self.loss)]

    def eval_points(self, metric: str | None) -> list[tuple[int, float]]:
        return sorted(self.evals.get(metric, {}).items()) if metric else []


# --------------------------------------------------------------------------- reading


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _step(x: Any, where: str) -> int | None:
    """A row's step (an integer, or a number or numeric text read as one); None where it is no
    finite number. A step outside int64 is an error naming ``where`` (the file and line)."""
    if isinstance(x, str):
        try:
            x = int(x.strip())
        except ValueError:
            pass
    if isinstance(x, int) and not isinstance(x, bool):
        step = x
    else:
        v = _num(x)
        if v is None:
            return None
        step = int(v)
    if not -2**63 <= step < 2**63:
        raise ValueError(f"{where}: step {x} is out of range (steps are 64-bit integers)")
    return step


def _is_loss_name(name: str) -> bool:
    n = name.split(" - ")[-1]
    if n.endswith(_WANDB_SUFFIX) or "eval/" in n:
        return False
    return "CE loss" in n or "train/loss" in n or n.strip().lower() == "loss"


def _loss_rank(name: str) -> int:
    n = name.split(" - ")[-1]
    return 0 if n == TRAIN_KEY else 1 if "CE loss" in n else 2 if "train/loss" in n else 3


def _build(label: str, source: str, rows: list[tuple[int, float | None, dict[str, float]]]) -> Run:
    """Rows of (step, loss or None, {eval metric: value}); a repeated step keeps its last row."""
    train: dict[int, float] = {}
    evals: dict[str, dict[int, float]] = {}
    per: dict[str, dict[int, dict[int, float]]] = {}
    for step, loss, ev in rows:
        if loss is not None:
            train[step] = loss
        for k, v in ev.items():
            m = _PER_BATCH.match(k)
            if m:
                per.setdefault(m.group(1), {}).setdefault(step, {})[int(m.group(2))] = v
            else:
                evals.setdefault(k, {})[step] = v
    if not train and not evals:
        raise ValueError(f"{source}: no training loss ({TRAIN_KEY}) and no eval/... metrics found")
    steps = np.array(sorted(train), dtype=np.int64)
    return Run(label, source, steps, np.array([train[s] for s in steps], dtype=np.float64), evals,
               {m: {s: [d[i] for i in sorted(d)] for s, d in by.items()} for m, by in per.items()})


def metric_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``metrics.jsonl`` in file order, OLMo-core names (blank lines and
    non-objects skipped).

    The one tolerance: a last line without its newline that does not parse is a crashed writer's
    partial row and is dropped; any other unparsable line is an error naming the file and line."""
    return [row for _, row in _numbered_rows(path)]


def _numbered_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``metric_rows`` with each row's 1-based line number."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    row = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:
                    if not line.endswith("\n"):
                        break
                    raise ValueError(f"{path}:{n}: not a JSON object") from None
                if isinstance(row, dict):
                    rows.append((n, {MAXTEXT_NAMES.get(k, k): v for k, v in row.items()}))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a JSON-lines text file (byte {e.start} is not UTF-8)") from None
    return rows


def read_metrics(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """The training rows (those with ``train/CE loss``) of ``RUN_DIR/metrics.jsonl`` by step."""
    return {int(r["step"]): r for r in metric_rows(Path(run_dir) / "metrics.jsonl") if TRAIN_KEY in r}


def _read_jsonl(path: Path, label: str) -> Run:
    rows = []
    for n, row in _numbered_rows(path):
        step = _step(row.get("step"), f"{path}:{n}")
        if step is not None:
            ev = {k: v for k, v in ((k, _num(v)) for k, v in row.items() if k.startswith("eval/")) if v is not None}
            rows.append((step, _num(row.get(TRAIN_KEY)), ev))
    return _build(label, str(path), rows)


def _table_text(path: Path) -> str:
    """A CSV or TSV export, read whole (line ends kept, for the csv module)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a CSV or TSV text file (byte {e.start} is not UTF-8)") from None


def _read_table(path: Path, label: str | None, default: str, delimiter: str) -> list[Run]:
    reader = csv.reader(io.StringIO(_table_text(path), newline=""), delimiter=delimiter)
    numbered = [(reader.line_num, r) for r in reader if r and any(c.strip() for c in r)]
    if not numbered:
        raise ValueError(f"{path}: empty file")
    head = [MAXTEXT_NAMES.get(c.strip(), c.strip()) for c in numbered[0][1]]
    if all(_num(c) is not None for c in head):   # headerless "step<TAB>loss"
        if len(head) < 2:
            raise ValueError(f"{path}: expected step and loss columns")
        rows = [(step, _num(r[1]), {}) for n, r in numbered
                if len(r) > 1 and (step := _step(r[0], f"{path}:{n}")) is not None]
        return [_build(label or default, str(path), rows)]
    step_col = next((head.index(c) for c in STEP_COLUMNS if c in head), None)
    if step_col is None:
        raise ValueError(f"{path}: no step column (one of {', '.join(STEP_COLUMNS)}) in header {head}")
    loss_cols = sorted((i for i, c in enumerate(head) if _is_loss_name(c)), key=lambda i: _loss_rank(head[i]))
    eval_cols = [i for i, c in enumerate(head) if "eval/" in c and not c.endswith(_WANDB_SUFFIX)]
    if not loss_cols and not eval_cols:
        raise ValueError(f"{path}: no loss column (a name containing 'CE loss' or 'train/loss', or 'loss') "
                         f"in header {head}")
    # W&B puts several runs side by side as "RUN - metric"; one run per prefix.
    prefixes: dict[str, list[int]] = {}
    for i in loss_cols:
        prefixes.setdefault(head[i].split(" - ")[0] if " - " in head[i] else "", []).append(i)
    if not prefixes:
        prefixes[""] = []
    runs = []
    for pre, cols in prefixes.items():
        lc = cols[0] if cols else None
        ecols = [i for i in eval_cols if (head[i].split(" - ")[0] if " - " in head[i] else "") == pre]
        rows = []
        for n, r in numbered[1:]:
            step = _step(r[step_col], f"{path}:{n}") if step_col < len(r) else None
            if step is None:
                continue
            loss = _num(r[lc]) if lc is not None and lc < len(r) else None
            ev = {head[i][head[i].index("eval/"):]: _num(r[i]) for i in ecols if i < len(r)}
            rows.append((step, loss, {k: v for k, v in ev.items() if v is not None}))
        if len(prefixes) > 1:
            name = f"{label}/{pre}" if label else pre
        else:
            name = label or pre or default
        runs.append(_build(name, str(path), rows))
    return runs


def read_runs(path: str | Path, label: str | None = None) -> list[Run]:
    """Every run in ``path`` (a run directory, ``metrics.jsonl``, a TSV or a W&B CSV)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{p}: no metrics.jsonl (expected an olmax run directory)")
        return [_read_jsonl(p / "metrics.jsonl", label or p.name)]
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist")
    default = p.parent.name if p.name == "metrics.jsonl" else p.stem
    with open(p, encoding="utf-8", errors="replace") as f:
        first = f.readline().lstrip()
    if p.suffix in (".jsonl", ".json") or first.startswith("{"):
        return [_read_jsonl(p, label or default)]
    if p.suffix == ".csv":
        return _read_table(p, label, default, ",")
    return _read_table(p, label, default, "\t" if "\t" in first else ",")


def read_run(path: str | Path, label: str | None = None) -> Run:
    runs = read_runs(path, label)
    if len(runs) != 1:
        raise ValueError(f"{path} holds {len(runs)} runs ({', '.join(r.label for r in runs)}); expected one")
    return runs[0]


def mean_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (Bessel-corrected std / sqrt(n)); None where undefined
    (no values; for the error, fewer than two)."""
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return None, None
    return float(v.mean()), (float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) >= 2 else None)
