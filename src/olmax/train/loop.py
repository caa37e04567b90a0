"""The training loop, top to bottom in one function.

Contract with checkpoints: checkpoint ``N`` holds the state after N updates (global step N)
and the data state ``batches_processed = N``; resuming from it trains global batch index N
(0-based) next. The published reproduction resumed the model at N+1 with the loader at N; a
test pins this numbering.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax import io
from olmax.checkpoint.remote import RunMirror
from olmax.checkpoint.state import abstract_train_state, shardings
from olmax.checkpoint.store import CheckpointError, Checkpointer, CorruptCheckpointError, StopSignal
from olmax.config import Config, ConfigError
from olmax.eval.alarm import ALARM, MemorisationAlarm
from olmax.eval.heldout import HeldoutEvaluator
from olmax.metrics.flops import device_peak_flops, flops_per_token, mfu
from olmax.metrics.sinks import JsonlSink, MetricsLogger, ProgressBar, TensorBoardSink, WandbSink, named
from olmax.model.dispatch import describe
from olmax.model.params import init_params
from olmax.optim import init_opt_state
from olmax.sharding import make_mesh, plan_batch
from olmax.train.init import TrainData, git_commit, load_initial_state, versions
from olmax.train.runlock import RunLock
from olmax.train.step import jit_train_step


# What each objective's loss is called in messages (``TrainResult.losses`` holds it).
LOSS_NAMES = {"lm": "CE loss", "dpo": "DPO loss", "grpo": "policy loss"}


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    start_step: int
    end_step: int
    losses: dict[int, float]          # step (1-based) -> the objective's loss (LOSS_NAMES)
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
    from olmax.rl.rollout import updates_per_step
    rl = cfg.train.objective == "grpo"
    updates = updates_per_step(cfg)  # optimizer updates per step (RL: per rollout batch)
    # RL: one update sees one mini-batch of the step's completions
    per_update = cfg.train.global_batch_size // (cfg.rl.num_mini_batches if rl else 1)
    plan = plan_batch(per_update, dict(mesh.shape), cfg.train.micro_batch_size, cfg.train.max_micro_batch_size)
    total = cfg.train.steps
    L = cfg.data.sequence_length

    # -- state: resume, or initialise (from scratch or converted weights) -------------------------
    abstract = abstract_train_state(cfg, mesh)
    pshard, oshard = shardings(abstract["params"]), shardings(abstract["opt_state"])
    ckpt_root = run_dir if mirror is not None else run  # where the checkpoints live (remote or local)
    ckpt = Checkpointer(ckpt_root, cfg.checkpoint)
    if is_main:
        _check_writable(ckpt.directory)  # before training: Orbax's failed save hung ~300 s first
    # Newest first; a damaged checkpoint is named and skipped for the previous complete one.
    candidates = list(reversed(ckpt.all_steps()))
    damaged: list[str] = []
    start, data_state = _pick_checkpoint(ckpt, ckpt_root, cfg, candidates, damaged)

    # -- data first: a bad path or a changed dataset fails before anything is allocated or compiled.
    # The order is a pure function of the step; resume checks the fingerprint.
    loader = _train_data(cfg, start or 0, data_state, allow_fingerprint_mismatch, mesh, run, dataset)
    evaluator = HeldoutEvaluator(cfg, mesh, per_batch=True) if cfg.eval.heldout_paths else None
    alarm = None
    if cfg.eval.reference:
        alarm = MemorisationAlarm(cfg.eval.reference, label=cfg.name, reference=cfg.eval.reference)

    # Written into every checkpoint; computed once (git runs a subprocess).
    run_meta = {"config_yaml": cfg.to_yaml(), "versions": versions(), "git_commit": git_commit(),
                "seed": cfg.train.seed}
    while start is not None:
        try:
            state, meta = ckpt.restore(start, abstract, verify=False)  # _pick_checkpoint verified it
            break
        except CorruptCheckpointError as e:
            _warn_damaged(e, damaged)
            loader.close()
            candidates = [c for c in candidates if c < start]
            start, data_state = _pick_checkpoint(ckpt, ckpt_root, cfg, candidates, damaged)
            loader = _train_data(cfg, start or 0, data_state, allow_fingerprint_mismatch, mesh, run, dataset)
    # Damaged checkpoints newer than the one resumed are renamed (never deleted): the run will
    # write those steps again, and rotation must not count them as good ones.
    for bad in [c for c in ckpt.all_steps() if start is None or c > start]:
        moved = ckpt.set_aside(bad)
        if moved is not None:
            print(f"olmax: moved the damaged checkpoint {bad} aside to {moved}", file=sys.stderr, flush=True)
    if start is not None:
        params, opt_state = state["params"], state["opt_state"]
        if int(meta["step"]) != start or int(opt_state.step) != start * updates:
            raise ConfigError(f"checkpoint {start} in {run} is inconsistent: meta step {meta['step']}, "
                              f"optimizer step {int(opt_state.step)}")
        if is_main:
            print(f"resuming from checkpoint {start} in {run} (next: global batch {start})", file=sys.stderr)
            if cfg.train.init_from:  # a warm start is for a fresh run only: the checkpoint wins
                print(f"olmax: note: train.init_from={cfg.train.init_from} is ignored: the run directory already "
                      f"has checkpoint {start}", file=sys.stderr)
    else:
        start = 0
        if cfg.train.init_from:
            params, opt_state = load_initial_state(cfg, cfg.train.init_from, mesh, pshard, oshard)
        else:
            params = jax.jit(partial(init_params, cfg.model), out_shardings=pshard)(jax.random.key(cfg.train.seed))
            opt_state = jax.jit(partial(init_opt_state, optim_cfg=cfg.optim), out_shardings=oshard)(params)
        if is_main:
            (run / "config.yaml").write_text(run_meta["config_yaml"])
            (run / "run_info.json").write_text(json.dumps({
                "git_commit": run_meta["git_commit"], "versions": run_meta["versions"], "mesh": dict(mesh.shape),
                "devices": jax.device_count(), "processes": jax.process_count(),
                "implementations": describe(cfg.model, platform),  # attention, kernels (olmax.model.dispatch)
                "device_kind": jax.devices()[0].device_kind, "batch_plan": dataclasses.asdict(plan)}, indent=2))

    dpo = cfg.train.objective == "dpo"
    if dpo:  # the reference log-probs, computed once before the first update (olmax.train.dpo)
        loader.prepare(lambda: params if start == 0 else _initial_params(cfg, mesh, pshard, oshard), pshard, plan,
                       say=lambda m: print(m, file=sys.stderr, flush=True) if is_main else None)

    # -- the step -------------------------------------------------------------------------------
    if dpo:
        from olmax.train.dpo import jit_dpo_step
        step_fn = jit_dpo_step(cfg, mesh, plan, pshard, oshard)
    elif rl:
        from olmax.rl.step import RlStep
        # KL to the initial weights: a frozen second copy, only when rl.kl_beta > 0
        reference = _initial_params(cfg, mesh, pshard, oshard) if cfg.rl.kl_beta > 0 else None
        step_fn = RlStep(cfg, mesh, plan, pshard, oshard, reference=reference)
    else:
        step_fn = jit_train_step(cfg, mesh, plan, pshard, oshard)

    sinks = []
    if is_main:
        # TensorBoard is rebuilt from metrics.jsonl on resume (rows a kill -9 caught in its buffer)
        sinks = [JsonlSink(run / "metrics.jsonl"),
                 TensorBoardSink(run / "tensorboard", rebuild_from=run / "metrics.jsonl")]
        if cfg.wandb.project:  # the same rows in W&B; a W&B failure warns once and never stops training
            sinks.append(WandbSink(cfg.wandb, run, config=cfg.to_dict(), name=Path(str(run_dir)).name))
    logger = MetricsLogger(sinks)
    # Lines past the resumed checkpoint come from a crashed run: drop them so the metrics equal
    # those of an uninterrupted run.
    logger.truncate_after(start)
    bar = ProgressBar(total, start) if (is_main and progress) else None
    fl_tok = flops_per_token(cfg.model, L)["total"]
    peak = device_peak_flops(jax.devices()[0].device_kind)
    if os.environ.get("OLMAX_PEAK_TFLOPS"):  # a device olmax has no figure for (the CPU, a new chip)
        try:
            peak = float(os.environ["OLMAX_PEAK_TFLOPS"]) * 1e12
        except ValueError:
            peak = math.nan
        if not (math.isfinite(peak) and peak > 0):
            raise ConfigError(f"OLMAX_PEAK_TFLOPS must be a number > 0 (peak TFLOP/s per device), got "
                              f"{os.environ['OLMAX_PEAK_TFLOPS']!r}")
    tokens_per_step = cfg.train.global_batch_size * L * (2 if dpo else 1)  # DPO: a chosen and a rejected row per pair

    losses: dict[int, float] = {}
    pending: tuple[int, dict, float] | None = None
    stopped = False
    last_time = time.perf_counter()
    # Throughput: time from one step's result to the next, less the host's pauses in between
    # (checkpoint saves, their checksums, held-out evals, uploads), when the device sits idle.
    clock = {"last_done": last_time, "paused": 0.0}
    max_nonfinite = cfg.optim.skip_step.max_nonfinite_steps
    nonfinite_run: list[int] = []     # steps of the current run of consecutive non-finite updates
    failure: str | None = None        # set when the run must stop with an error

    def say(msg: str) -> None:
        if bar:
            bar.write(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def emit(step: int, metrics: dict, dt: float) -> None:
        nonlocal failure
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if dpo or rl:  # the DPO / RL loss stands where the CE loss stands; its metrics are full names
            m["ce_loss"] = m.pop("loss")
        losses[step] = m["ce_loss"]
        t = time.perf_counter()  # step ``step`` has finished: its metrics are on the host
        dt = t - clock["last_done"] - clock["paused"]
        clock.update(last_done=t, paused=0.0)
        if rl:  # the RL step is synchronous: its own clock (sampling + updates) times it
            dt = m.get("rl/time_generation_s", 0.0) + m.get("rl/time_training_s", 0.0)
        tps_dev = tokens_per_step / dt / jax.device_count() if dt > 0 else 0.0
        # OLMo-core's names, each value once (``named``).
        row = named({**({} if (dpo or rl) else {"ce_loss": m["ce_loss"], "z_loss": m["z_loss"]}),
                     "grad_norm": m["grad_norm"], "lr": m["lr"],
                     "step_skipped": m["step_skipped"], "total_tokens": step * tokens_per_step,
                     "tps_device": tps_dev, "mfu": mfu(fl_tok, tps_dev, peak),
                     "tflops_device": fl_tok * tps_dev / 1e12,
                     NONFINITE_METRIC: m["nonfinite"],
                     **{k: v for k, v in m.items() if k.startswith(("dpo/", "rl/"))}})
        bad = m["nonfinite"] > 0
        nonfinite_run[:] = nonfinite_run + [step] if bad else []
        if bad and is_main and failure is None:  # past the limit the run is stopping: no more warnings
            what = "skipped" if m["step_skipped"] else "APPLIED (optim.skip_step.olmo_core_nonfinite)"
            say(f"olmax: WARNING step {step}: non-finite {LOSS_NAMES[cfg.train.objective]} {m['ce_loss']} / "
                f"grad norm {m['grad_norm']}; update {what} ({len(nonfinite_run)} in a row; the run stops at "
                f"{max_nonfinite})")
        if bad and len(nonfinite_run) >= max_nonfinite and failure is None:
            failure = (f"{len(nonfinite_run)} consecutive updates had a non-finite loss or gradient norm (steps "
                       f"{nonfinite_run[0]}..{nonfinite_run[-1]}); none of them was checkpointed; "
                       f"{_resume_advice(ckpt, run)} (optim.skip_step.max_nonfinite_steps={max_nonfinite})")
        if step % cfg.train.log_interval == 0 or step == total or bad:
            logger.log(step, row)
        if alarm is not None:
            alarm.update(step, m["ce_loss"])
        if bar:
            bar.update(step, loss=m["ce_loss"], tokens_per_sec=tps_dev * jax.device_count())

    step = start
    with StopSignal() as stop:
        for step in range(start, total):
            batch = loader.rollouts(step, params) if rl else loader.global_batch(step)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            now = time.perf_counter()
            # Metrics of the previous step are fetched now, while this step runs on the device.
            if pending is not None:
                emit(*pending)
            pending = (step + 1, metrics, now - last_time)
            last_time = now
            done = step + 1
            ran = done - start
            stop_now = _any_process(stop.requested) or (max_steps_this_run is not None and ran >= max_steps_this_run)
            if evaluator is not None and (done % cfg.eval.interval == 0 or done == total):
                emit(*pending)
                pending = None
                t_pause = time.perf_counter()
                ev = evaluator.evaluate(params)
                logger.log(done, ev)
                if bar:
                    bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items() if "[" not in k))
                if alarm is not None:
                    msg = alarm.update(done, None, ev["eval/heldout/CE loss"])
                    if msg:
                        print(msg, file=sys.stderr, flush=True)
                        logger.log(done, {"eval/memorisation alarm": float(alarm.status == ALARM)})
                clock["paused"] += time.perf_counter() - t_pause
            if failure is not None:
                break
            forced = done == total or stop_now
            if (ckpt.should_save(done) or forced) and pending is not None:
                emit(*pending)  # know whether step ``done`` was non-finite before saving it
                pending = None
                if failure is not None:
                    break
            if ckpt.should_save(done) and nonfinite_run and not forced:
                say(f"olmax: WARNING not saving checkpoint {done} in the middle of {len(nonfinite_run)} non-finite "
                    "steps; the next checkpoint after a finite step will be saved")
            elif ckpt.should_save(done) or forced:
                if not bool(all_finite((params, opt_state.mu, opt_state.nu))):
                    # Never write a non-finite state: it would rotate finite checkpoints away.
                    failure = (f"the parameters or Adam moments are non-finite after step {done}; not saving "
                               f"checkpoint {done}; {_resume_advice(ckpt, run)}")
                    break
                t_pause = time.perf_counter()
                meta = {"step": done, "data_state": loader.state(done).to_dict(),
                        "fingerprint": loader.fingerprint, **run_meta}
                saved = ckpt.save(done, {"params": params, "opt_state": opt_state}, meta, force=stop_now or done == total)
                if saved and mirror is not None and is_main:
                    logger.flush()
                    mirror.push()
                clock["paused"] += time.perf_counter() - t_pause
            t_pause = time.perf_counter()
            ckpt.poll()  # checksums as soon as an asynchronous save has committed
            if pending is None:  # a pause only while the device is idle (no step of ours in flight)
                clock["paused"] += time.perf_counter() - t_pause
            if stop_now:
                stopped = done < total
                step = done
                break
        else:
            step = total
    if pending is not None:
        emit(*pending)
    ckpt.wait()
    ckpt.close()
    logger.close()
    if bar:
        bar.close()
    loader.close()
    if mirror is not None and is_main:
        mirror.push()
    if failure is not None:
        raise NonFiniteError(failure)
    return TrainResult(str(run_dir) if mirror is not None else str(run), start, step, losses, stopped)


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
    if cfg.train.objective != "lm":
        raise ConfigError("train.epochs is for train.objective=lm; set train.steps for the number of updates")
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


def _train_data(cfg: Config, start: int, data_state: dict | None, allow_mismatch: bool, mesh: Any, run: Path,
                dataset: Any = None) -> Any:
    """The loop's data: token instances (LM), preference pairs with reference log-probs (DPO) or
    prompts and the rollouts sampled from them (RL)."""
    if cfg.train.objective == "dpo":
        from olmax.train.dpo import DpoData
        return DpoData(cfg, start, data_state, allow_mismatch, mesh, run)
    if cfg.train.objective == "grpo":
        from olmax.rl.rollout import RlData
        return RlData(cfg, start, data_state, allow_mismatch, mesh, run)
    return TrainData(cfg, start, data_state, allow_mismatch, mesh, cache_dir=run / "order_cache", trace_dir=run,
                     dataset=dataset)


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
