"""The memorisation alarm: training loss better than the reference while held-out loss is not.

In the published OLMo 3 reproduction a data-loader bug (double sharding turned one epoch into
sampling with replacement) made the training loss look 0.06 nats *better* than AI2's curve
while held-out C4 loss did not move: the model was memorising repeated instances. Only
held-out evaluation exposed it. This module turns that observation into a rule.

Checks happen where there is fresh held-out evidence: at every step S where the run logged a
held-out loss (offline, a run without any is checked once, at its last step). Gaps are run minus
reference, in nats (negative = run better):

- ``train_gap`` = mean of ``train_run(s) - train_ref(s)`` over the run's logged steps s in
  ``(S - window, S]`` (the reference linearly interpolated at s, never extrapolated);
  at least ``min_points`` such steps, else ``insufficient-data``;
- ``heldout_gap`` = ``heldout_run(S) - heldout_ref(S)`` (the reference interpolated between its
  held-out steps, never extrapolated);
- ``ok`` if ``train_gap >= -threshold`` (training not better than the reference beyond noise);
- otherwise training improved: ``memorisation`` (the alarm) if
  ``heldout_gap > heldout_fraction * train_gap``, i.e. held-out loss kept less than
  ``heldout_fraction`` of the training gain (with the defaults, at a 0.02 train gain the held-out
  gap must be below -0.005); ``ok`` if held-out improved along; ``unverified`` if there is no
  held-out comparison at S (said out loud, but it is not proof either way).

Defaults: ``threshold`` 0.02 nats (the reproduction tracked AI2 within +-0.012 when healthy),
``heldout_fraction`` 0.25, ``window`` 1000 steps in the in-loop hook (``olmax compare`` uses the
gap plot's bin width), ``min_points`` 3.

Offline: ``check_memorisation(...)``. In the loop:
``MemorisationAlarm(reference).update(step, train_loss, heldout_loss)``.
No JAX (a reference given as a path is read with ``olmax.eval.runs``), so it never touches the
device.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from olmax.eval.runs import mean_se, read_run

Curve = Mapping[int, float] | Sequence[tuple[int, float]]

OK, ALARM, UNVERIFIED, NO_DATA = "ok", "memorisation", "unverified", "insufficient-data"


@dataclass(frozen=True)
class AlarmConfig:
    threshold: float = 0.02          # nats; a train gap below -threshold means "training improved"
    heldout_fraction: float = 0.25   # held-out must keep at least this share of the training gain
    window: int | None = None        # steps averaged; None: 1000 in the hook, the bin width in compare
    min_points: int = 3              # train points needed in the window to judge

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"alarm threshold must be > 0 nats, got {self.threshold}")
        if not 0 <= self.heldout_fraction <= 1:
            raise ValueError(f"alarm heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"alarm window must be a positive number of steps, got {self.window}")
        if self.min_points < 1:
            raise ValueError(f"alarm min_points must be >= 1, got {self.min_points}")


@dataclass
class AlarmCheck:
    step: int
    status: str
    train_gap: float | None          # mean over the window
    train_gap_se: float | None       # standard error of that mean
    train_points: int
    heldout_gap: float | None
    heldout_step: int | None


@dataclass
class AlarmResult:
    label: str
    reference: str
    status: str                      # memorisation if any check fired, else the last check's status
    fired: bool
    first_fired_step: int | None
    threshold: float
    heldout_fraction: float
    window: int
    message: str
    checks: list[AlarmCheck] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- curves


def points(curve: Curve | None) -> list[tuple[int, float]]:
    """Sorted ``(step, value)`` pairs with finite values; a repeated step keeps its last value."""
    if curve is None:
        return []
    items: Iterable = curve.items() if isinstance(curve, Mapping) else curve
    d: dict[int, float] = {}
    for s, v in items:
        if v is not None and math.isfinite(float(v)):
            d[int(s)] = float(v)
    return sorted(d.items())


def interp(pts: Sequence[tuple[int, float]], step: float) -> float | None:
    """Linear interpolation inside the curve's step range; exact at logged steps; None outside."""
    if not pts or step < pts[0][0] or step > pts[-1][0]:
        return None
    i = bisect.bisect_left(pts, (step, -math.inf))
    s1, v1 = pts[i]
    if s1 == step or i == 0:
        return v1
    s0, v0 = pts[i - 1]
    return v0 + (v1 - v0) * (step - s0) / (s1 - s0)


# --------------------------------------------------------------------------- the rule


def judge(train_gap: float | None, train_points: int, heldout_gap: float | None, cfg: AlarmConfig) -> str:
    """The rule of the module docstring, for one check."""
    if train_gap is None or train_points < cfg.min_points:
        return NO_DATA
    if train_gap >= -cfg.threshold:
        return OK
    if heldout_gap is None:
        return UNVERIFIED
    return ALARM if heldout_gap > cfg.heldout_fraction * train_gap else OK


def describe(check: AlarmCheck, cfg: AlarmConfig, window: int, label: str, ref: str) -> str:
    """A one-paragraph message for a check (loud for the alarm)."""
    s = check.step
    if check.status == ALARM:
        need = cfg.heldout_fraction * (check.train_gap or 0.0)
        return (f"!!! MEMORISATION ALARM ({label} vs {ref}) at step {s}: training CE loss is "
                f"{-check.train_gap:.4f} nats better than {ref} (mean over steps {s - window + 1}..{s}, "
                f"{check.train_points} points) but held-out loss is {check.heldout_gap:+.4f} nats against it "
                f"(step {check.heldout_step}; a real gain would be <= {need:+.4f}). Training gains that do not "
                "show on held-out data mean repeated data: check the data loader (double sharding, resume "
                "offset, epoch bookkeeping) before trusting this run. !!!")
    if check.status == UNVERIFIED:
        return (f"warning ({label} vs {ref}) at step {s}: training CE loss is {-check.train_gap:.4f} nats better "
                f"than {ref} and there is no held-out comparison in the window: this may be memorisation of "
                "repeated data. Evaluate held-out loss on both (olmax eval loss) before trusting the gain.")
    if check.status == NO_DATA:
        return f"{label} vs {ref}: not enough aligned training points to judge (need {cfg.min_points} in the window)"
    hg = "n/a" if check.heldout_gap is None else f"{check.heldout_gap:+.4f}"
    return (f"{label} vs {ref} at step {s}: ok (train gap {check.train_gap:+.4f}, held-out gap {hg}; "
            f"alarm below -{cfg.threshold:g} train with held-out gap > {cfg.heldout_fraction:g} x train gap)")


def _check_at(step: int, run_train: list, ref_train: list, heldout_gap: float | None,
              cfg: AlarmConfig, window: int) -> AlarmCheck:
    lo = step - window
    i0 = bisect.bisect_right(run_train, (lo, math.inf))
    i1 = bisect.bisect_right(run_train, (step, math.inf))
    gaps = []
    for s, v in run_train[i0:i1]:
        r = interp(ref_train, s)
        if r is not None:
            gaps.append(v - r)
    mean, se = mean_se(gaps)
    hstep = step if heldout_gap is not None else None
    return AlarmCheck(step, judge(mean, len(gaps), heldout_gap, cfg), mean, se, len(gaps), heldout_gap, hstep)


def _heldout_gap(run_value: float | None, ref_held: list, step: int) -> float | None:
    r = interp(ref_held, step) if run_value is not None else None
    return None if r is None else run_value - r  # type: ignore[operator]


def check_memorisation(run_train: Curve, ref_train: Curve, run_heldout: Curve | None = None,
                       ref_heldout: Curve | None = None, cfg: AlarmConfig = AlarmConfig(), *,
                       label: str = "run", reference: str = "reference", window: int | None = None) -> AlarmResult:
    """Check a whole run against a reference at each held-out step of the run and at its last step."""
    w = window or cfg.window or 1000
    rt, ft, rh, fh = points(run_train), points(ref_train), points(run_heldout), points(ref_heldout)
    if rh:
        checks = [_check_at(s, rt, ft, _heldout_gap(v, fh, s), cfg, w) for s, v in rh]
    else:
        checks = [_check_at(rt[-1][0], rt, ft, None, cfg, w)] if rt else []
    fired = [c for c in checks if c.status == ALARM]
    if fired:
        worst = min(fired, key=lambda c: c.train_gap or 0.0)
        msg = describe(worst, cfg, w, label, reference)
        msg += f" (fired at {len(fired)} of {len(checks)} checks, first at step {fired[0].step})"
        status = ALARM
    elif checks:
        status, msg = checks[-1].status, describe(checks[-1], cfg, w, label, reference)
    else:
        status, msg = NO_DATA, f"{label} vs {reference}: no training points to judge"
    return AlarmResult(label, reference, status, bool(fired), fired[0].step if fired else None,
                       cfg.threshold, cfg.heldout_fraction, w, msg, checks)


# --------------------------------------------------------------------------- in-loop hook


class MemorisationAlarm:
    """In-loop hook: call ``update(step, train_loss, heldout_loss=None)`` after each logged step,
    with the held-out loss at the steps where it was evaluated.

    ``reference_curve``: the reference training loss (``{step: loss}``, ``[(step, loss)]``, or a
    path ``olmax compare`` reads; a path's held-out rows become ``reference_heldout`` unless given).
    Training-only updates just record. An update with a held-out loss runs a check and returns its
    message when the status is ``memorisation`` (every time) or ``unverified``; otherwise None.
    ``status`` is the latest check's status, ``result()`` summarises all checks.
    """

    def __init__(self, reference_curve: Curve | str, reference_heldout: Curve | None = None, *,
                 threshold: float = 0.02, heldout_fraction: float = 0.25, window: int = 1000,
                 min_points: int = 3, label: str = "this run", reference: str = "the reference",
                 heldout_metric: str = "eval/heldout/CE loss"):
        if isinstance(reference_curve, str) or hasattr(reference_curve, "__fspath__"):
            ref = read_run(str(reference_curve))
            reference_curve = ref.train_points()
            if reference_heldout is None:
                reference_heldout = ref.eval_points(heldout_metric)
        self.cfg = AlarmConfig(threshold, heldout_fraction, window, min_points)
        self.window = window
        self.label, self.reference = label, reference
        self.ref_train = points(reference_curve)  # type: ignore[arg-type]
        self.ref_held = points(reference_heldout)
        if not self.ref_train:
            raise ValueError("memorisation alarm: the reference curve has no points")
        self.train: list[tuple[int, float]] = []
        self.status = NO_DATA
        self.checks: list[AlarmCheck] = []

    def update(self, step: int, train_loss: float | None, heldout_loss: float | None = None) -> str | None:
        step = int(step)
        if train_loss is not None and math.isfinite(float(train_loss)):
            if self.train and self.train[-1][0] >= step:   # a repeated (or replayed) step replaces
                self.train = [p for p in self.train if p[0] < step]
            self.train.append((step, float(train_loss)))
        # Only the window matters; keep memory flat over millions of steps.
        while self.train and self.train[0][0] <= step - self.window:
            self.train.pop(0)
        if heldout_loss is None:
            return None
        c = _check_at(step, self.train, self.ref_train, _heldout_gap(float(heldout_loss), self.ref_held, step),
                      self.cfg, self.window)
        self.status = c.status
        self.checks.append(c)
        if c.status in (ALARM, UNVERIFIED):
            return describe(c, self.cfg, self.window, self.label, self.reference)
        return None

    def result(self) -> AlarmResult:
        """The checks so far, summarised like ``check_memorisation``."""
        fired = [c for c in self.checks if c.status == ALARM]
        shown = fired[0] if fired else (self.checks[-1] if self.checks else None)
        msg = describe(shown, self.cfg, self.window, self.label, self.reference) if shown else "no held-out checks yet"
        return AlarmResult(self.label, self.reference, ALARM if fired else self.status, bool(fired),
                           fired[0].step if fired else None, self.cfg.threshold, self.cfg.heldout_fraction,
                           self.window, msg, list(self.checks))
