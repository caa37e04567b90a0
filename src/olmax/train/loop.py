"""The training loop, whatever the objective: ``train`` sets the run up, restores or initialises
the state, then runs the steps, logging each one's metrics and saving checkpoints. What a step
optimises, its data and its metrics are the objective's (``olmax.objectives``); the loop looks it
up once and compares no objective names.

Contract with checkpoints: checkpoint ``N`` holds the state after N updates (global step N)
and the data state ``batches_processed = N``; resuming from it trains global batch index N
(0-based) next. The published reproduction resumed the model at N+1 with the loader at N; a
test pins this numbering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax import io
from olmax.checkpoint.remote import RunMirror
from olmax.checkpoint.state import abstract_train_state, shardings
from olmax.checkpoint.store import Checkpointer, CheckpointError, CorruptCheckpointError, StopSignal
from olmax.config import Config, ConfigError
from olmax.eval.alarm import ALARM, MemorisationAlarm
from olmax.eval.heldout import HeldoutEvaluator
from olmax.metrics.flops import device_peak_flops, flops_per_token, mfu
from olmax.metrics.sinks import JsonlSink, MetricsLogger, ProgressBar, TensorBoardSink, WandbSink, named
from olmax.model.dispatch import describe
from olmax.model.params import init_params
from olmax.objectives import get_objective
from olmax.objectives.base import Data, Objective
from olmax.optim import init_opt_state
from olmax.sharding import BatchPlan, make_mesh, plan_batch
from olmax.train.init import git_commit, load_initial_state, versions
from olmax.train.runlock import RunLock


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    start_step: int
    end_step: int
    losses: dict[int, float]          # step (1-based) -> the objective's loss (``Objective.loss_name``)
    stopped_early: bool


def _any_process(flag: bool) -> bool:
    """A signal may reach one host only; every process must agree to save (orbax's save is a
    collective and would hang otherwise)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _remote_mirror(run_dir: str | os.PathLike):
    if not io.is_remote(run_dir):
        return None
    if not str(run_dir).startswith(("s3://", "gs://", "gcs://")):
        raise ConfigError(f"run directory {run_dir}: remote run directories must be s3:// or gs:// "
                          "(http(s) is read-only)")
    mirror = RunMirror(str(run_dir))
    if jax.process_index() == 0:
        mirror.pull()
    return mirror


def train(cfg: Config, run_dir: str | os.PathLike, *, allow_fingerprint_mismatch: bool = False,
          max_steps_this_run: int | None = None, progress: bool = True) -> TrainResult:
    """Train ``cfg`` in ``run_dir``, resuming from its newest complete checkpoint if any.

    ``max_steps_this_run`` stops early (after a checkpoint) — used by the resume A/B. A local run
    directory is locked for the run (``olmax.train.runlock``): a second trainer on it refuses."""
    lock = None
    if not io.is_remote(run_dir) and jax.process_index() == 0 and not Path(run_dir).is_file():
        lock = RunLock(run_dir)
    try:
        return _train(cfg, run_dir, allow_fingerprint_mismatch=allow_fingerprint_mismatch,
                      max_steps_this_run=max_steps_this_run, progress=progress)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: Config, run_dir: str | os.PathLike, *, allow_fingerprint_mismatch: bool,
           max_steps_this_run: int | None, progress: bool) -> TrainResult:
    if max_steps_this_run is not None and max_steps_this_run <= 0:
        raise ConfigError(f"--max-steps-this-run must be positive, got {max_steps_this_run}")
    cfg, dataset = resolve_epochs(cfg)  # the dataset it built (packing is not free) goes to the loader
    objective = get_objective(cfg)
    r = _setup(cfg, objective, run_dir)

    # -- data first: a bad path or a changed dataset fails before anything is allocated or compiled.
    # The order is a pure function of the step; resume checks the fingerprint.
    def open_data(start: int | None, data_state: dict | None) -> Data:
        return objective.data(start or 0, data_state, allow_fingerprint_mismatch, r.mesh, r.run, dataset)

    # Newest first; a damaged checkpoint is named and skipped for the previous complete one.
    candidates = list(reversed(r.ckpt.all_steps()))
    damaged: list[str] = []
    start, data_state = _pick_checkpoint(r.ckpt, r.ckpt_root, cfg, candidates, damaged)
    loader = open_data(start, data_state)
    evaluator = HeldoutEvaluator(cfg, r.mesh, per_batch=True) if cfg.eval.heldout_paths else None
    alarm = None
    if cfg.eval.reference:
        alarm = MemorisationAlarm(cfg.eval.reference, label=cfg.name, reference=cfg.eval.reference)

    start, loader, params, opt_state = _restore_or_init(r, start, loader, open_data, candidates, damaged)
    objective.prepare(loader, lambda: params if start == 0 else r.initial_params(), r.pshard, r.plan,
                      say=lambda m: print(m, file=sys.stderr, flush=True) if r.is_main else None)
    step_fn = objective.loop_step(r.mesh, r.plan, r.pshard, r.oshard, r.initial_params)

    log = _StepLog(r, start, progress, alarm)
    try:
        end, stopped = _run_steps(r, loader, step_fn, params, opt_state, start, log, evaluator, max_steps_this_run)
        r.ckpt.wait()
    finally:
        # the progress bar ends its line even when a step raises: the error gets a line of its own
        log.close()
    r.ckpt.close()
    log.report_empty(len(log.losses))  # the steps this run finished
    loader.close()
    if r.mirror is not None and r.is_main:
        r.mirror.push()
    if log.failure is not None:
        raise NonFiniteError(log.failure)
    return TrainResult(str(run_dir) if r.mirror is not None else str(r.run), start, end, log.losses, stopped)


# --------------------------------------------------------------------------- setup and state


@dataclasses.dataclass
class _Run:
    """What a run fixes before its first step: where it writes, its mesh and batch plan, the
    state's shardings and its checkpoints."""

    cfg: Config
    objective: Objective
    run: Path                         # the local run directory (a remote one's mirror)
    mirror: RunMirror | None          # an s3:// or gs:// run directory's
    ckpt_root: str | os.PathLike      # where the checkpoints live (remote or local)
    ckpt: Checkpointer
    mesh: Any
    plan: BatchPlan
    abstract: dict[str, Any]
    pshard: Any
    oshard: Any
    meta: dict[str, Any]              # written into every checkpoint
    is_main: bool

    def initial_params(self) -> Any:
        """The weights a fresh run starts from, again (a new copy)."""
        return _initial_params(self.cfg, self.mesh, self.pshard, self.oshard)


def _setup(cfg: Config, objective: Objective, run_dir: str | os.PathLike) -> _Run:
    # An s3:// or gs:// run directory is written through a local mirror (olmax.checkpoint.remote).
    mirror = _remote_mirror(run_dir)
    run = mirror.local if mirror is not None else Path(run_dir)
    if run.exists() and not run.is_dir():
        raise ConfigError(f"run directory {run} is a file, not a directory; choose another --run-dir")
    run.mkdir(parents=True, exist_ok=True)
    is_main = jax.process_index() == 0
    mesh = make_mesh(cfg.mesh)
    platform = mesh.devices.flat[0].platform
    if cfg.model.attention_impl == "cudnn" and platform != "gpu":  # a user's choice, not a crash to retry
        raise ConfigError(f"model.attention_impl=cudnn needs GPUs, these devices are {platform}: use auto, xla, "
                          "blocked or reference")
    if cfg.model.attention_impl == "cpu" and platform != "cpu":
        raise ConfigError(f"model.attention_impl=cpu is olmax's CPU kernel, these devices are {platform}: use auto")
    # The plan splits what one optimizer update sees (RL: one mini-batch of the step's completions).
    plan = plan_batch(objective.update_batch_size(), dict(mesh.shape), cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)
    abstract = abstract_train_state(cfg, mesh)
    ckpt_root = run_dir if mirror is not None else run
    ckpt = Checkpointer(ckpt_root, cfg.checkpoint)
    if is_main:
        _check_writable(ckpt.directory)  # before training: Orbax's failed save hung ~300 s first
    # Written into every checkpoint; computed once (git runs a subprocess).
    meta = {"config_yaml": cfg.to_yaml(), "versions": versions(), "git_commit": git_commit(), "seed": cfg.train.seed}
    return _Run(cfg, objective, run, mirror, ckpt_root, ckpt, mesh, plan, abstract, shardings(abstract["params"]),
                shardings(abstract["opt_state"]), meta, is_main)


def _restore_or_init(r: _Run, start: int | None, loader: Data, open_data: Callable[[int | None, dict | None], Data],
                     candidates: list[int], damaged: list[str]) -> tuple[int, Data, Any, Any]:
    """``(start, data, params, opt_state)``: the state of checkpoint ``start`` (falling back past
    damaged ones, the data reopened at each), or of a fresh run (``start`` None: step 0)."""
    while start is not None:
        try:
            state, meta = r.ckpt.restore(start, r.abstract, verify=False)  # _pick_checkpoint verified it
            break
        except CorruptCheckpointError as e:
            _warn_damaged(e, damaged)
            loader.close()
            candidates = [c for c in candidates if c < start]
            start, data_state = _pick_checkpoint(r.ckpt, r.ckpt_root, r.cfg, candidates, damaged)
            loader = open_data(start, data_state)
    # Damaged checkpoints newer than the one resumed are renamed (never deleted): the run will
    # write those steps again, and rotation must not count them as good ones.
    for bad in [c for c in r.ckpt.all_steps() if start is None or c > start]:
        moved = r.ckpt.set_aside(bad)
        if moved is not None:
            print(f"olmax: moved the damaged checkpoint {bad} aside to {moved}", file=sys.stderr, flush=True)
    if start is None:
        return 0, loader, *_fresh_state(r)
    params, opt_state = state["params"], state["opt_state"]
    if not bool(all_finite((params, opt_state.mu, opt_state.nu))):  # written by no olmax that checks before saving
        raise CheckpointError(f"checkpoint {start} in {r.run} holds non-finite parameters or Adam moments: move it "
                              "aside (or delete it) to resume from the one before")
    if int(meta["step"]) != start or int(opt_state.step) != start * r.objective.updates_per_step():
        raise ConfigError(f"checkpoint {start} in {r.run} is inconsistent: meta step {meta['step']}, "
                          f"optimizer step {int(opt_state.step)}")
    if r.is_main:
        print(f"resuming from checkpoint {start} in {r.run} (next: global batch {start})", file=sys.stderr)
        if r.cfg.train.init_from:  # a warm start is for a fresh run only: the checkpoint wins
            print(f"olmax: note: train.init_from={r.cfg.train.init_from} is ignored: the run directory already "
                  f"has checkpoint {start}", file=sys.stderr)
    return start, loader, params, opt_state


def _fresh_state(r: _Run) -> tuple[Any, Any]:
    """The parameters and optimizer state of step 0 (converted weights or the seeded init); the
    run directory gets its config and run information."""
    cfg = r.cfg
    if cfg.train.init_from:
        params, opt_state = load_initial_state(cfg, cfg.train.init_from, r.mesh, r.pshard, r.oshard)
    else:
        params = jax.jit(partial(init_params, cfg.model), out_shardings=r.pshard)(jax.random.key(cfg.train.seed))
        opt_state = jax.jit(partial(init_opt_state, optim_cfg=cfg.optim), out_shardings=r.oshard)(params)
    if r.is_main:
        (r.run / "config.yaml").write_text(r.meta["config_yaml"])
        (r.run / "run_info.json").write_text(json.dumps({
            "git_commit": r.meta["git_commit"], "versions": r.meta["versions"], "mesh": dict(r.mesh.shape),
            "devices": jax.device_count(), "processes": jax.process_count(),
            "implementations": describe(r.cfg.model, r.mesh.devices.flat[0].platform,  # olmax.model.dispatch
                                        r.cfg.data.sequence_length),
            "device_kind": jax.devices()[0].device_kind, "batch_plan": dataclasses.asdict(r.plan)}, indent=2))
    return params, opt_state


# --------------------------------------------------------------------------- the steps


def _run_steps(r: _Run, loader: Data, step_fn: Callable, params: Any, opt_state: Any, start: int, log: _StepLog,
               evaluator: HeldoutEvaluator | None, max_steps_this_run: int | None) -> tuple[int, bool]:
    """Steps ``start``.. to ``train.steps`` (or a stop): ``(the step reached, stopped early)``.
    A step's metrics are fetched while the next one runs on the device, except where the host
    must know them first: before a held-out eval and before a checkpoint."""
    total, ckpt = r.cfg.train.steps, r.ckpt
    pending: tuple[int, dict] | None = None   # a step (1-based) whose metrics are still on the device
    stopped = False
    step = start
    with StopSignal() as stop:
        for step in range(start, total):
            batch = r.objective.batch(loader, step, params)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            # Metrics of the previous step are fetched now, while this step runs on the device.
            if pending is not None:
                log.emit(*pending)
            pending = (step + 1, metrics)
            done = step + 1
            ran = done - start
            stop_now = _any_process(stop.requested) or (max_steps_this_run is not None and ran >= max_steps_this_run)
            if evaluator is not None and (done % r.cfg.eval.interval == 0 or done == total):
                log.emit(*pending)
                pending = None
                with log.host_pause():
                    log.heldout(done, evaluator.evaluate(params))
            if log.failure is not None:
                break
            forced = done == total or stop_now
            if (ckpt.should_save(done) or forced) and pending is not None:
                log.emit(*pending)  # know whether step ``done`` was non-finite before saving it
                pending = None
                if log.failure is not None:
                    break
            if forced and log.last_words(done, ran):  # the run's newest state is broken: no checkpoint of it
                break
            if ckpt.should_save(done) and log.nonfinite_run and not forced:
                log.say(f"olmax: WARNING not saving checkpoint {done} in the middle of {len(log.nonfinite_run)} "
                        "non-finite steps; the next checkpoint after a finite step will be saved")
            elif ckpt.should_save(done) or forced:
                _save(r, loader, log, done, params, opt_state, force=stop_now or done == total)
                if log.failure is not None:
                    break
            t_pause = time.perf_counter()
            ckpt.poll()  # checksums as soon as an asynchronous save has committed
            if pending is None:  # a pause only while the device is idle (no step of ours in flight)
                log.paused += time.perf_counter() - t_pause
            if stop_now:
                stopped = done < total
                step = done
                break
        else:
            step = total
    if pending is not None:
        log.emit(*pending)
    return step, stopped


def _save(r: _Run, loader: Data, log: _StepLog, done: int, params: Any, opt_state: Any, force: bool) -> None:
    """Checkpoint ``done``: the state and the data state (pushed to a remote run directory once
    saved). A non-finite state is never written (it would rotate finite checkpoints away): the
    run fails instead."""
    if not bool(all_finite((params, opt_state.mu, opt_state.nu))):
        log.failure = (f"the parameters or Adam moments are non-finite after step {done}; not saving "
                       f"checkpoint {done}; {_resume_advice(r.ckpt, r.run)}")
        return
    with log.host_pause():
        meta = {"step": done, "data_state": loader.state(done).to_dict(), "fingerprint": loader.fingerprint, **r.meta}
        saved = r.ckpt.save(done, {"params": params, "opt_state": opt_state}, meta, force=force)
        if saved and r.mirror is not None and r.is_main:
            log.logger.flush()
            r.mirror.push()


# --------------------------------------------------------------------------- metrics


class _StepLog:
    """Each step's metrics on the host: the row (JSONL, TensorBoard, W&B) in OLMo-core's names,
    throughput, the progress bar, the memorisation alarm, and the watch on non-finite updates
    that stops a run (``failure``)."""

    def __init__(self, r: _Run, start: int, progress: bool, alarm: MemorisationAlarm | None):
        self.r, self.cfg, self.objective, self.alarm = r, r.cfg, r.objective, alarm
        sinks = []
        if r.is_main:
            # TensorBoard is rebuilt from metrics.jsonl on resume (rows a kill -9 caught in its buffer)
            sinks = [JsonlSink(r.run / "metrics.jsonl"),
                     TensorBoardSink(r.run / "tensorboard", rebuild_from=r.run / "metrics.jsonl")]
            if self.cfg.wandb.project:  # the same rows in W&B; a W&B failure warns once and never stops training
                sinks.append(WandbSink(self.cfg.wandb, r.run, config=self.cfg.to_dict(),
                                       name=Path(str(r.ckpt_root)).name))  # the run directory's name
        self.logger = MetricsLogger(sinks)
        # Lines past the resumed checkpoint come from a crashed run: drop them so the metrics equal
        # those of an uninterrupted run.
        self.logger.truncate_after(start)
        self.bar = ProgressBar(self.cfg.train.steps, start) if (r.is_main and progress) else None
        self.fl_tok = flops_per_token(self.cfg.model, self.cfg.data.sequence_length)["total"]
        self.peak = _peak_flops()
        self.tokens_per_step = self.objective.tokens_per_step()
        self.losses: dict[int, float] = {}
        self.nonfinite_run: list[int] = []    # steps of the current run of consecutive non-finite updates
        self.empty: list[int] = []            # steps whose batch held no trained token (this process's run)
        self.last_loss = math.nan
        self.counted = False                  # whether the objective counts its steps' trained tokens
        self.failure: str | None = None       # set when the run must stop with an error
        # Throughput: time from one step's result to the next, less the host's pauses in between
        # (checkpoint saves, their checksums, held-out evals, uploads), when the device sits idle.
        self.last_done = time.perf_counter()
        self.paused = 0.0

    @contextlib.contextmanager
    def host_pause(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - t

    def say(self, msg: str) -> None:
        if self.bar:
            self.bar.write(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def emit(self, step: int, metrics: dict) -> None:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        loss = self.objective.loss(m)
        self.losses[step] = loss
        t = time.perf_counter()  # step ``step`` has finished: its metrics are on the host
        dt = self.objective.step_seconds(m, t - self.last_done - self.paused)
        self.last_done, self.paused = t, 0.0
        tps_dev = self.tokens_per_step / dt / jax.device_count() if dt > 0 else 0.0
        # OLMo-core's names, each value once (``named``).
        row = named({**self.objective.logged(m), "grad_norm": m["grad_norm"], "lr": m["lr"],
                     "step_skipped": m["step_skipped"], "total_tokens": step * self.tokens_per_step,
                     "tps_device": tps_dev, "mfu": mfu(self.fl_tok, tps_dev, self.peak),
                     "tflops_device": self.fl_tok * tps_dev / 1e12, NONFINITE_METRIC: m["nonfinite"]})
        bad = m["nonfinite"] > 0
        self.last_loss = loss
        trained = self.objective.trained_tokens(m)
        self.counted = trained is not None
        if trained is not None and trained <= 0:
            self.empty.append(step)
            if self.r.is_main and len(self.empty) <= 3:
                self.say(f"olmax: WARNING step {step}: its batch holds no trained token ({self.objective.empty_batch})"
                         + ("; further such steps are counted, not printed" if len(self.empty) == 3 else ""))
        self._watch_nonfinite(step, bad, loss, m)
        if step % self.cfg.train.log_interval == 0 or step == self.cfg.train.steps or bad:
            self.logger.log(step, row)
        if self.alarm is not None:
            self.alarm.update(step, loss)
        if self.bar:
            self.bar.update(step, loss=loss, tokens_per_sec=tps_dev * jax.device_count())

    def _watch_nonfinite(self, step: int, bad: bool, loss: float, m: dict[str, float]) -> None:
        limit = self.cfg.optim.skip_step.max_nonfinite_steps
        self.nonfinite_run[:] = self.nonfinite_run + [step] if bad else []
        if bad and self.r.is_main and self.failure is None:  # past the limit the run is stopping: no more warnings
            what = "skipped" if m["step_skipped"] else "APPLIED (optim.skip_step.olmo_core_nonfinite)"
            self.say(f"olmax: WARNING step {step}: non-finite {self.objective.loss_name} {loss} / grad norm "
                     f"{m['grad_norm']}; update {what} ({len(self.nonfinite_run)} in a row; the run stops at "
                     f"{limit})")
        if bad and len(self.nonfinite_run) >= limit and self.failure is None:
            run = self.nonfinite_run
            self.failure = (f"{len(run)} consecutive updates had a non-finite loss or gradient norm (steps "
                            f"{run[0]}..{run[-1]}; likely cause: {self.cause(run[-1])}); none of them was "
                            f"checkpointed; {_resume_advice(self.r.ckpt, self.r.run)} "
                            f"(optim.skip_step.max_nonfinite_steps={limit})")

    def cause(self, step: int) -> str:
        """The likely cause of a non-finite step, in words."""
        if step in self.empty:
            after = (f"; after {len(self.losses) - 1} earlier steps of this run, optim.lr={self.cfg.optim.lr} may "
                     "have made the model degenerate" if step in self.losses and len(self.losses) > 1 else "")
            return f"its batch holds no trained token ({self.objective.empty_batch}){after}"
        return (f"the learning rate (optim.lr={self.cfg.optim.lr}) or the data (a bad batch)"
                + ("; the step's batch did hold trained tokens" if self.counted else ""))

    def last_words(self, done: int, ran: int) -> bool:
        """Whether the state after step ``done``, the last this run saves, must not be the run's
        last word: its update was non-finite, or no step of the run trained on a token. Sets
        ``failure`` (the run exits 2, no checkpoint of that state) and says so."""
        if self.failure is None and self.nonfinite_run:
            self.failure = (f"step {done}, the last of this run, had a non-finite {self.objective.loss_name} "
                            f"({self.last_loss}); likely cause: {self.cause(done)}; checkpoint {done} is not "
                            f"written (a run never ends on a non-finite step, however short); "
                            f"{_resume_advice(self.r.ckpt, self.r.run)}")
        elif self.failure is None and ran > 0 and len(self.empty) >= ran:
            self.failure = (f"no step of this run ({ran}) trained on a single token: every batch held no trained "
                            f"token ({self.objective.empty_batch}); checkpoint {done} is not written")
        return self.failure is not None

    def report_empty(self, ran: int) -> None:
        """The closing count of the steps that trained on nothing."""
        if self.empty and self.r.is_main:
            print(f"olmax: WARNING {len(self.empty)} of this run's {ran} steps held no trained token (steps "
                  f"{', '.join(map(str, self.empty[:10]))}{', ...' if len(self.empty) > 10 else ''}): "
                  f"{self.objective.empty_batch}", file=sys.stderr, flush=True)

    def heldout(self, done: int, ev: dict[str, float]) -> None:
        """The held-out eval after step ``done``."""
        self.logger.log(done, ev)
        if self.bar:
            self.bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items() if "[" not in k))
        if self.alarm is not None:
            msg = self.alarm.update(done, None, ev["eval/heldout/CE loss"])
            if msg:
                print(msg, file=sys.stderr, flush=True)
                self.logger.log(done, {"eval/memorisation alarm": float(self.alarm.status == ALARM)})

    def close(self) -> None:
        self.logger.close()
        if self.bar:
            self.bar.close()
            self.bar = None


def _peak_flops() -> float:
    """This device's peak FLOP/s (for MFU): olmax's figure, or ``OLMAX_PEAK_TFLOPS`` for a device
    olmax has no figure for (the CPU, a new chip)."""
    peak = device_peak_flops(jax.devices()[0].device_kind)
    if os.environ.get("OLMAX_PEAK_TFLOPS"):
        try:
            peak = float(os.environ["OLMAX_PEAK_TFLOPS"]) * 1e12
        except ValueError:
            peak = math.nan
        if not (math.isfinite(peak) and peak > 0):
            raise ConfigError(f"OLMAX_PEAK_TFLOPS must be a number > 0 (peak TFLOP/s per device), got "
                              f"{os.environ['OLMAX_PEAK_TFLOPS']!r}")
    return peak


# --------------------------------------------------------------------------- helpers


NONFINITE_METRIC = "optim/non-finite step"


def _check_writable(directory: Path) -> None:
    """A checkpoint folder this process cannot write into (read-only mount, permissions) is a
    one-line error at the start, not after the training it would have saved."""
    probe = directory / f".olmax-write-probe.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint folder {directory} is not writable ({e.strerror or e}): fix its "
                              "permissions or use another --run-dir") from None


def _resume_advice(ckpt: Any, run: Path) -> str:
    """What to do after a non-finite stop: resume from the newest (finite) checkpoint, or, when the
    run never wrote one, start again with other settings."""
    steps = ckpt.all_steps()
    if steps:
        return (f"the newest checkpoint, {ckpt.directory / str(max(steps))}, is finite: lower optim.lr or check "
                "the data, then resume")
    return (f"no checkpoint was written in {run / 'checkpoints'}: lower optim.lr, check the data and the "
            "model.init_std / model.norm_eps values, then start again")


def resolve_epochs(cfg: Config) -> tuple[Config, Any]:
    """``train.epochs`` as ``train.steps``: epochs x the whole global batches of one epoch. Returns
    the resolved config and the dataset built to count them (None without ``train.epochs``)."""
    if cfg.train.epochs is None:
        return cfg, None
    if not get_objective(cfg).allows_epochs:
        raise ConfigError(f"train.epochs counts whole batches of token instances, not for train.objective="
                          f"{cfg.train.objective}: set train.steps for the number of updates")
    from olmax.data.loader import build_dataset
    dataset = build_dataset(cfg)
    n = len(dataset)
    per_epoch = n // cfg.train.global_batch_size
    if per_epoch < 1:
        raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} is larger than the dataset's "
                          f"{n} instances: not one whole batch per epoch")
    steps = cfg.train.epochs * per_epoch
    if jax.process_index() == 0:
        print(f"olmax: train.epochs={cfg.train.epochs}: {n} instances, {per_epoch} global batches an epoch -> "
              f"train.steps={steps}", file=sys.stderr, flush=True)
    return cfg.override([f"train.steps={steps}"]), dataset


def _initial_params(cfg: Config, mesh: Any, pshard: Any, oshard: Any) -> Any:
    """The weights a fresh run starts from (``train.init_from`` or the seeded init), again."""
    if cfg.train.init_from:
        return load_initial_state(cfg, cfg.train.init_from, mesh, pshard, oshard)[0]
    return jax.jit(partial(init_params, cfg.model), out_shardings=pshard)(jax.random.key(cfg.train.seed))


class NonFiniteError(ValueError):
    """The run stopped because its loss, gradients or state went non-finite (nothing bad saved)."""


@jax.jit
def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _warn_damaged(e: Exception, damaged: list[str]) -> None:
    damaged.append(str(e))
    if jax.process_index() == 0:
        print(f"olmax: WARNING {e}; falling back to the previous complete checkpoint", file=sys.stderr, flush=True)


def _pick_checkpoint(ckpt: Any, run: str | os.PathLike, cfg: Config, candidates: list[int], damaged: list[str]
                     ) -> tuple[int | None, dict | None]:
    """The newest of ``candidates`` (descending) whose meta is readable and whose files pass their
    checksums, and its data state; damaged ones are named on stderr and skipped. With none left
    after a damaged one: a one-line error (never a silent fresh start over a damaged run)."""
    for step in candidates:
        problem: CorruptCheckpointError | None = None
        try:
            meta = ckpt.read_meta(run, step)
            verified = ckpt.verify(step) if cfg.checkpoint.checksums else True
        except CorruptCheckpointError as e:
            problem = e
        # Each process verifies its own files: all must agree before anyone restores.
        if _any_process(problem is not None):
            _warn_damaged(problem or CorruptCheckpointError(
                f"checkpoint {ckpt.directory / str(step)} failed its checksums on another process"), damaged)
            continue
        ckpt.check_compatible(meta, cfg)
        if not verified and jax.process_index() == 0:
            print(f"olmax: note: checkpoint {ckpt.directory / str(step)} has no checksums (written with "
                  "checkpoint.checksums=false, or stopped before they were written); restoring it unverified",
                  file=sys.stderr, flush=True)
        if int(meta.get("step", step)) > cfg.train.steps:
            raise CheckpointError(f"train.steps={cfg.train.steps} is below checkpoint {step} in {run}: the run "
                                  f"already trained {step} steps. Set train.steps >= {step} or use another --run-dir")
        if "data_state" not in meta:
            _warn_damaged(CorruptCheckpointError(f"checkpoint {ckpt.directory / str(step)} has no data state"), damaged)
            continue
        return step, meta["data_state"]
    if damaged:
        raise CheckpointError(f"no usable checkpoint in {ckpt.directory}: " + " | ".join(damaged)
                              + ". Move the damaged checkpoints aside (or start a new --run-dir)")
    return None, None
