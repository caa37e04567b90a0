"""Metric sinks: ``RUN_DIR/metrics.jsonl`` (always), TensorBoard events, Weights & Biases (when
``wandb.project`` is set), and a progress bar.

Every row carries ``step``, the 1-based count of optimizer updates, so that step N in the
metrics is the update whose result checkpoint N holds. Only process 0 should own sinks.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import secrets
import string
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import urlparse

import numpy as np

from olmax.config import WandbConfig
from olmax.extras import require

# Short key -> logged name: OLMo-core's names, each value once (``olmax.eval.runs`` reads the
# MaxText reproduction's own names for these under OLMo-core's when runs are compared).
METRIC_NAMES: dict[str, str] = {
    "ce_loss": "train/CE loss",
    "z_loss": "train/Z loss",
    "grad_norm": "optim/total grad norm",          # before clipping
    "lr": "optim/LR (group 0)",
    "step_skipped": "optim/step skipped",
    "total_tokens": "throughput/total tokens",
    "tps_device": "throughput/device/TPS",
    "mfu": "throughput/MFU",
    "tflops_device": "throughput/device/TFLOPs",  # model FLOPs per second per device, in TFLOP/s
}


def named(values: Mapping[str, Any]) -> dict[str, Any]:
    """Map short keys (``ce_loss``) to logged names; keys that are already full names (containing
    ``/``) pass through."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if k in METRIC_NAMES:
            out[METRIC_NAMES[k]] = v
        elif "/" in k:
            out[k] = v
        else:
            raise KeyError(f"unknown metric key {k!r}; known: {', '.join(METRIC_NAMES)} (or a full 'group/name')")
    return out


def to_scalar(name: str, value: Any) -> int | float:
    """Python, numpy or jax scalar -> int (integers, bools) or float."""
    arr = np.asarray(value)  # fetches a jax array from the device
    if arr.size != 1:
        raise ValueError(f"metric {name!r} is not a scalar (shape {arr.shape})")
    if arr.dtype.kind in "biu":
        return int(arr.reshape(()))
    if arr.dtype.kind == "f" or "float" in arr.dtype.name:
        return float(arr.reshape(()))  # ml_dtypes floats (bf16) report kind "V"
    raise TypeError(f"metric {name!r} has non-numeric type {type(value).__name__}")


class Sink(Protocol):
    def write(self, step: int, values: Mapping[str, int | float]) -> None: ...
    def close(self) -> None: ...


# --------------------------------------------------------------------------- JSONL


class JsonlSink:
    """One JSON object per line, ``{"step": N, name: value, ...}``, flushed at every write.

    Opening an existing file appends (resume). Call ``truncate_after(N)`` when resuming from
    checkpoint N so rows a crashed run wrote past N go, and the file equals an uninterrupted
    run's. Non-finite values are written as ``NaN``/``Infinity`` (Python's json; not strict JSON).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._check_text()
        self._drop_partial_tail()
        self._f: TextIO | None = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, values: Mapping[str, int | float]) -> None:
        assert self._f is not None, "write after close"
        self._f.write(json.dumps({"step": step, **values}) + "\n")
        self._f.flush()

    def truncate_after(self, step: int) -> None:
        """Keep only rows with ``step <= step``; the rewrite is atomic (tmp file + rename)."""
        if self._f is not None:
            self._f.close()
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [ln for ln in lines if ln.endswith("\n") and not _row_after(ln, step)]
            if kept != lines:
                tmp = self.path.with_name(self.path.name + ".tmp")
                with open(tmp, "w", encoding="utf-8") as f:
                    f.writelines(kept)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def _check_text(self) -> None:
        # Before anything is truncated: a file that is not UTF-8 text is not ours to rewrite.
        if not self.path.exists():
            return
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a directory, not a metrics file; move it aside to resume")
        try:
            self.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: not a JSON-lines text file (byte {e.start} is not UTF-8); it was left "
                             "untouched: move it aside (or restore it) to resume") from None

    def _drop_partial_tail(self) -> None:
        # A crash mid-write leaves an unterminated last line; appending to it would corrupt the
        # next row too. Everything before the last newline is kept.
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _row_after(line: str, step: int) -> bool:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return False  # not ours to judge: keep it
    return isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] > step


# --------------------------------------------------------------------------- TensorBoard


class TensorBoardSink:
    """Scalars in TensorBoard event files, tags exactly as named (spaces and brackets kept).

    ``truncate_after(N)`` (before the first write, on resume from checkpoint N) makes TensorBoard
    hide the steps > N a crashed run wrote (tensorboardX's ``purge_step``). With ``rebuild_from``
    (the run's ``metrics.jsonl``, flushed at every row) it instead rewrites the event files from
    that file's rows <= N: the rows a ``kill -9`` caught in tensorboardX's buffer come back, and
    no step appears twice. Events are flushed every ``flush_secs`` seconds while running.
    """

    def __init__(self, logdir: str | os.PathLike, purge_step: int | None = None,
                 rebuild_from: str | os.PathLike | None = None, flush_secs: int = 10):
        self.logdir = Path(logdir)
        self._purge_step = purge_step
        self._rebuild_from = Path(rebuild_from) if rebuild_from is not None else None
        self._flush_secs = flush_secs
        self._writer: Any = None

    def truncate_after(self, step: int) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._rebuild_from is None:
            self._purge_step = step + 1
            return
        old = sorted(self.logdir.glob("events.out.tfevents.*")) if self.logdir.is_dir() else []
        rows = []
        if self._rebuild_from.exists():
            for line in self._rebuild_from.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] <= step:
                    rows.append(row)
        self._purge_step = None
        for row in rows:
            values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                      and not isinstance(v, bool)}
            self.write(int(row.pop("step")), values)
        self.flush()  # the new file holds everything before the old ones go
        for f in old:
            f.unlink(missing_ok=True)

    def _get(self) -> Any:
        if self._writer is None:
            from tensorboardX import SummaryWriter
            # Event file names carry whole seconds only; a second writer in the same second would
            # truncate the first file (opened "wb"). The ns suffix keeps names distinct and ordered.
            self._writer = SummaryWriter(str(self.logdir), purge_step=self._purge_step, flush_secs=self._flush_secs,
                                         filename_suffix=f".{time.time_ns()}.{os.getpid()}")
        return self._writer

    def write(self, step: int, values: Mapping[str, int | float]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary
        # SummaryWriter.add_scalar rewrites tags ("train/CE loss" -> "train/CE_loss"); writing
        # the Summary proto ourselves keeps the names identical to metrics.jsonl and OLMo-core.
        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._get().file_writer.add_summary(summary, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# --------------------------------------------------------------------------- Weights & Biases


class WandbSink:
    """The rows of ``metrics.jsonl`` in a W&B run: the same names, olmax's step as W&B's step.

    The run's id is kept in ``RUN/wandb_run_id`` (uploaded and downloaded with a remote run
    directory), so every restart resumes the same W&B run; steps W&B already holds (a crashed run
    logged past the checkpoint resumed: the same losses, bitwise, other timings) are not sent
    twice. W&B's own files go to ``WANDB_DIR`` or ``RUN/wandb``. ``wandb`` is imported at the first
    row. A W&B failure (no network, a bad key, its service gone) never stops training: it is
    reported once on stderr and the sink goes quiet; ``metrics.jsonl`` and TensorBoard carry on.
    """

    ID_FILE = "wandb_run_id"

    def __init__(self, cfg: WandbConfig, run_dir: str | os.PathLike, config: Mapping[str, Any] | None = None,
                 name: str | None = None, err: TextIO | None = None):
        require("wandb", "wandb")  # a missing package stops the run at its start, unlike W&B's own failures
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._config = dict(config or {})
        self._name = cfg.name or name or self.run_dir.resolve().name
        self._err = err
        self._run: Any = None
        self._failed = False
        self._first_new_step = 0  # W&B's next step after a resume: rows before it are there already

    def write(self, step: int, values: Mapping[str, int | float]) -> None:
        if self._failed:
            return
        try:
            if self._run is None:
                self._start()
            if step >= self._first_new_step:
                self._run.log(dict(values), step=step)
        except Exception as e:  # noqa: BLE001 (whatever W&B raises, training goes on)
            self._fail(e)

    def close(self) -> None:
        if self._run is not None and not self._failed:
            try:
                self._run.finish()
            except Exception as e:  # noqa: BLE001
                self._fail(e)
        self._run = None

    def run_id(self) -> str:
        """This run directory's W&B run id, made (and written) on first use."""
        path = self.run_dir / self.ID_FILE
        if path.exists():
            rid = path.read_text(encoding="utf-8", errors="replace").strip()
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", rid):
                raise ValueError(f"{path} does not hold a W&B run id (got {rid[:40]!r}); fix or delete it")
            return rid
        rid = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as W&B's own
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(rid + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return rid

    def _start(self) -> None:
        import wandb  # only when W&B logging is on: it is a large import and starts a service

        c = self.cfg
        mode = _wandb_mode(c.mode)
        self._run = wandb.init(
            project=c.project, entity=c.entity, name=self._name, group=c.group, tags=list(c.tags) or None,
            id=self.run_id(), resume="allow", mode=mode, config=self._config,
            dir=None if os.environ.get("WANDB_DIR") else str(self.run_dir),
            # olmax's stdout and stderr stay as they are (a --json report, the launcher's logs)
            settings=wandb.Settings(console="off"))
        if mode == "offline" and c.mode == "auto":
            print(f"olmax: W&B: no API key found (WANDB_API_KEY, `wandb login`): logging offline; upload with "
                  f"`wandb sync --id {self._run.id} {Path(self._run.dir).parent.parent}/offline-run-*`",
                  file=self._err or sys.stderr, flush=True)
        try:
            self._first_new_step = int(self._run.step)
        except Exception:  # noqa: BLE001 (offline runs start at 0; some modes have no step)
            self._first_new_step = 0

    def _fail(self, e: BaseException) -> None:
        self._failed = True
        msg = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"olmax: warning: W&B logging stopped ({type(e).__name__}: {msg}); training continues, and "
              "metrics.jsonl and TensorBoard have every row", file=self._err or sys.stderr, flush=True)
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass


def _wandb_mode(mode: str) -> str | None:
    """``auto``: W&B's own ``WANDB_MODE`` if set (None lets W&B read it), else online with an API
    key (``WANDB_API_KEY`` or the netrc entry ``wandb login`` writes), else offline."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return None
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if host and netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


# --------------------------------------------------------------------------- logger


class MetricsLogger:
    """Fan one row of metrics out to every sink. ``None`` values are skipped."""

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        row = {k: to_scalar(k, v) for k, v in values.items() if v is not None}
        for s in self.sinks:
            s.write(int(step), row)

    def truncate_after(self, step: int) -> None:
        """On resume from checkpoint ``step``: drop what a crashed run logged past it."""
        for s in self.sinks:
            if hasattr(s, "truncate_after"):
                s.truncate_after(step)

    def flush(self) -> None:
        for s in self.sinks:
            if hasattr(s, "flush"):
                s.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()


# --------------------------------------------------------------------------- progress


class ProgressBar:
    """A tqdm bar with ETA, loss and tokens/s on a terminal. When ``file`` is not a TTY (logs),
    tqdm stays silent and a plain line is printed every ``every`` steps (and at the last step).
    ``force=True`` shows the bar anyway, ``force=False`` never shows it."""

    def __init__(self, total_steps: int, initial_step: int = 0, *, every: int = 10,
                 file: TextIO | None = None, force: bool | None = None):
        self.total = total_steps
        self.initial = initial_step
        self.every = max(1, every)
        self.file = file if file is not None else sys.stderr
        self.step = initial_step
        self._t0 = time.perf_counter()
        self._first: tuple[int, float] | None = None  # (step, time) of the first update
        is_tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.use_bar = is_tty if force is None else force
        self._bar: Any = None
        if self.use_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=initial_step, file=self.file, unit="step",
                             dynamic_ncols=True, smoothing=0.1)

    def update(self, step: int, loss: float | None = None, tokens_per_sec: float | None = None) -> None:
        """``step``: updates done so far (1-based)."""
        self.step = step
        if self._first is None:  # the first step carries the compile: the ETA's rate starts after it
            self._first = (step, time.perf_counter())
        post = []
        if loss is not None:
            post.append(f"loss {float(loss):.4f}")
        if tokens_per_sec is not None:
            post.append(f"{_si(float(tokens_per_sec))} tok/s")
        if self._bar is not None:
            self._bar.set_postfix_str(", ".join(post), refresh=False)
            self._bar.update(step - self._bar.n)
        elif step % self.every == 0 or step == self.total:
            now = time.perf_counter()
            elapsed = now - self._t0
            first_step, first_t = self._first
            done = step - first_step
            eta = (self.total - step) * (now - first_t) / done if done > 0 else math.nan
            pct = 100.0 * step / self.total if self.total else 100.0
            line = f"step {step}/{self.total} ({pct:.1f}%)"
            if post:
                line += " " + " ".join(post)
            line += f" elapsed {_hms(elapsed)} eta {_hms(eta)}"
            print(line, file=self.file, flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message, file=self.file)
        else:
            print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"
