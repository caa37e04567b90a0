"""A training run's sharp edges end in one line naming the field, flag or file (exit 2), or in the
documented behaviour."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from olmax import cli
from olmax.config import Config, ConfigError
from olmax.data import DataError
from olmax.recipes import get_recipe
from olmax.train.loop import NonFiniteError, train
from trainlib import small_overrides


def cfg_for(paths, *extra):
    return get_recipe("tiny", small_overrides(paths, *extra))


def _numeric_fields(obj, path=""):
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        tp = hints[f.name]
        args = typing.get_args(tp)
        sub = [a for a in args if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(v):
            yield from _numeric_fields(v, f"{path}{f.name}.")
        elif sub:
            yield from _numeric_fields(sub[0](), f"{path}{f.name}.")
        elif tp in (int, float) or int in args or float in args:
            yield path + f.name


def test_every_numeric_field_refuses_nan_and_inf():
    fields = list(_numeric_fields(Config()))
    assert "model.norm_eps" in fields and "model.rope_scaling.factor" in fields and len(fields) > 60
    for name in fields:
        for bad in (".nan", ".inf", "-.inf"):
            with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
                get_recipe("tiny", [f"{name}={bad}"])


@pytest.mark.parametrize("override", [
    "model.norm_eps=0", "model.norm_eps=-1", "model.rope_theta=0", "model.rope_theta=-1", "model.init_std=0",
    "model.init_std=-1", "model.max_position_embeddings=0", "model.max_position_embeddings=-1",
    "data.seed=-5", "train.seed=-1", "model.rope_scaling.factor=0", "model.rope_scaling.beta_fast=-1",
    "mesh.fsdp=0", "mesh.data=-2", "mesh.fsdp_max=0", "dpo.beta=0", "dpo.label_smoothing=-1",
    "dpo.reference_batch_size=0"])
def test_nonsense_model_values_and_seeds_are_errors_naming_the_field(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + " must be"):
        get_recipe("tiny", [override])


def test_binary_or_duplicated_yaml_names_the_file(tmp_path, capsys):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    dup = tmp_path / "dup.yaml"
    dup.write_text("model:\n  d_model: 4\n  d_model: 8\n")
    for f, what in ((binary, "not a UTF-8"), (dup, "duplicate key 'd_model' at line 3")):
        assert cli.main(["print-config", str(f)]) == 2
        err = capsys.readouterr().err
        assert str(f) in err and what in err and "Traceback" not in err


def test_empty_mix_file_names_the_file(tmp_path, corpus):
    mix = tmp_path / "mix.txt"
    mix.write_text("# nothing here\n\n")
    with pytest.raises(DataError, match=f"mix file {mix} lists no token files"):
        train(cfg_for([str(mix)]), tmp_path / "run", progress=False)


def test_missing_heldout_file_names_eval_heldout_paths(tmp_path, corpus):
    missing = tmp_path / "heldout.npy"
    with pytest.raises(DataError, match=r"token file not found: .*heldout\.npy \(eval\.heldout_paths\)"):
        train(cfg_for(corpus, f"eval.heldout_paths={missing}"), tmp_path / "run", progress=False)


@pytest.mark.integration
def test_divergence_before_any_checkpoint_says_so_and_counts_to_the_limit(tmp_path, corpus, capfd):
    cfg = cfg_for(corpus, "train.steps=40", "checkpoint.interval=1000", "optim.lr=1e6", "optim.schedule.warmup=0",
                  "optim.skip_step.max_nonfinite_steps=3")
    with pytest.raises(NonFiniteError) as e:
        train(cfg, tmp_path / "run", progress=False)
    msg = str(e.value)
    assert "no checkpoint was written" in msg and "is finite" not in msg
    err = capfd.readouterr().err
    assert "(3 in a row; the run stops at 3)" in err and "4 in a row" not in err


def test_cudnn_attention_on_a_cpu_is_a_user_error(tmp_path, corpus, capsys):
    argv = ["train", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for o in small_overrides(corpus, "model.attention_impl=cudnn"):
        argv += ["--set", o]
    assert cli.main(argv) == 2  # launch local does not retry exit 2
    err = capsys.readouterr().err
    assert "model.attention_impl=cudnn needs GPUs" in err and "Traceback" not in err


@pytest.mark.integration
def test_a_second_trainer_on_a_run_directory_refuses_and_a_killed_ones_lock_is_taken_over(tmp_path, corpus):
    import os
    import signal
    import subprocess
    import sys

    from olmax.train.runlock import LOCK_NAME, RunDirectoryBusy

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from olmax.train.runlock import RunLock; "
                               f"RunLock({str(run)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryBusy, match=f"in use by another olmax train \\(pid {holder.pid} on "):
            train(cfg_for(corpus, "train.steps=2"), run, progress=False)
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert (run / LOCK_NAME).exists()  # stale: its process is gone, the kernel dropped the flock
    r = train(cfg_for(corpus, "train.steps=2"), run, progress=False)
    assert r.end_step == 2
    from olmax.train.runlock import RunLock
    RunLock(run).release()  # train released it at the end: the next run in this process may take it


def test_checksums_are_written_when_an_async_save_commits(tmp_path):
    import time

    import jax.numpy as jnp

    from olmax.checkpoint.store import Checkpointer
    from olmax.config import CheckpointConfig

    ck = Checkpointer(tmp_path / "run", CheckpointConfig(interval=1, async_save=True))
    ck.save(1, {"w": jnp.arange(1024.0)}, {"note": "x"})
    sums = ck.directory / "1" / "checksums.p0.json"
    for _ in range(400):  # the loop polls once a step; no second save is needed to seal the first
        ck.poll()
        if sums.exists():
            break
        time.sleep(0.05)
    assert sums.exists() and ck.verify(1)
    ck.close()


def test_tensorboard_is_rebuilt_from_metrics_jsonl_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from olmax.metrics.sinks import JsonlSink, MetricsLogger, TensorBoardSink

    jsonl, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    crashed = JsonlSink(jsonl)  # a run killed -9 after step 10: JSONL is flushed at every row ...
    for s in range(1, 11):
        crashed.write(s, {"train/CE loss": float(s)})
    crashed.close()
    for steps in ((1, 2, 3), (2, 3)):  # ... its TensorBoard buffer reached step 3, and an older file repeats 2..3
        part = TensorBoardSink(tb)
        for s in steps:
            part.write(s, {"train/CE loss": float(s)})
        part.close()
    resumed = MetricsLogger([JsonlSink(jsonl), TensorBoardSink(tb, rebuild_from=jsonl)])
    resumed.truncate_after(8)  # resumed from checkpoint 8
    for s in (9, 10):
        resumed.log(s, {"train/CE loss": 100.0 + s})
    resumed.close()
    acc = EventAccumulator(str(tb))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/CE loss")]
    assert got == [(s, float(s)) for s in range(1, 9)] + [(9, 109.0), (10, 110.0)]


def test_hf_to_olmax_keeps_the_hf_dtype_for_compute(tmp_path):
    from olmax.compat.hf import hf_to_olmax, random_hf_model
    from olmax.model.weights_io import load_config

    hf = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=64, eos_token_id=0,
              pad_token_id=1, bos_token_id=None)
    for dtype, cast, want in (("float32", None, "float32"), ("bfloat16", None, "bfloat16"),
                              ("bfloat16", "float32", "float32")):
        src = random_hf_model(tmp_path / f"hf-{dtype}-{cast}", dtype=dtype, **hf)
        cfg = hf_to_olmax(src, tmp_path / f"ox-{dtype}-{cast}", dtype=cast, progress=None)
        assert (cfg.model.param_dtype, cfg.model.compute_dtype) == (want, want)
        assert load_config(tmp_path / f"ox-{dtype}-{cast}").model.compute_dtype == want


@pytest.mark.integration
def test_throughput_excludes_checkpoint_pauses_and_mfu_is_written_given_a_peak(tmp_path, corpus, monkeypatch):
    import time

    from olmax.checkpoint.store import Checkpointer
    from olmax.verify.resume import read_metrics

    save = Checkpointer.save

    def slow_save(self, *a, **k):
        time.sleep(2.0)  # a slow disk
        return save(self, *a, **k)

    monkeypatch.setattr(Checkpointer, "save", slow_save)
    monkeypatch.setenv("OLMAX_PEAK_TFLOPS", "1")
    train(cfg_for(corpus, "train.steps=6", "checkpoint.interval=1"), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    tokens = 8 * 16
    dts = {step: tokens / rows[step]["throughput/device/TPS"] for step in rows}
    for step in range(3, 7):  # steps 1 and 2 include compiles
        assert dts[step] < 1.5, dts  # not the 2 s pause of the save before it
        assert rows[step]["throughput/MFU"] > 0 and rows[step]["throughput/device/TFLOPs"] > 0
        assert rows[step]["throughput/MFU"] == pytest.approx(rows[step]["throughput/device/TFLOPs"])  # peak 1 TFLOP/s
    monkeypatch.setenv("OLMAX_PEAK_TFLOPS", "nan")
    with pytest.raises(ConfigError, match="OLMAX_PEAK_TFLOPS"):
        train(cfg_for(corpus, "train.steps=7"), tmp_path / "run", progress=False)


def test_an_unwritable_checkpoint_folder_fails_before_training(tmp_path, corpus, monkeypatch):
    from pathlib import Path

    from olmax.checkpoint.store import CheckpointError

    write_bytes = Path.write_bytes

    def read_only(self, data):  # a read-only mount (chmod does not stop root, who runs these tests)
        if self.name.startswith(".olmax-write-probe"):
            raise PermissionError(30, "Read-only file system", str(self))
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*checkpoints is not writable \(Read-only"):
        train(cfg_for(corpus, "train.steps=2"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.integration
def test_grain_workers_die_with_a_killed_trainer(tmp_path, corpus):
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time\n"
            "from olmax.data.loader import DataLoader\n"
            "from olmax.recipes import get_recipe\n"
            f"cfg = get_recipe('tiny', {small_overrides(corpus, 'data.workers=2')!r})\n"
            f"it = iter(DataLoader(cfg, cache_dir={str(tmp_path / 'cache')!r}))\n"
            "next(it); print('reading', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    def descendants(pid: int) -> set[int]:
        kids = set()
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = open(f"/proc/{d}/stat").read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids |= {int(d)} | descendants(int(d))
        return kids

    try:
        assert p.stdout.readline().strip() == "reading"
        workers = descendants(p.pid)
        assert len(workers) >= 2, workers
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    def running(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 30
    while time.time() < deadline and any(running(w) for w in workers):
        time.sleep(0.5)
    assert not [w for w in workers if running(w)]


def test_a_worker_orphaned_before_its_init_hook_ran_dies_at_once():
    """The race behind a CI failure: a spawned worker still importing when the trainer is killed
    runs the hook under its new parent (PID 1); the trainer's pid passed in names the orphaning."""
    import subprocess
    import sys

    code = ("import time\n"
            "from olmax.data.loader import die_with_parent\n"
            "die_with_parent(1, 2, parent=0)  # no process here is a child of pid 0\n"
            "time.sleep(60)\n")
    p = subprocess.run([sys.executable, "-c", code], timeout=50)
    assert p.returncode == -9


@pytest.mark.integration
def test_init_from_on_a_run_with_checkpoints_says_it_is_ignored(tmp_path, corpus, capfd):
    run = tmp_path / "run"
    train(cfg_for(corpus, "train.steps=2"), run, progress=False)
    train(cfg_for(corpus, "train.steps=3", f"train.init_from=state:{run}"), run, progress=False)
    err = capfd.readouterr().err
    assert f"train.init_from=state:{run} is ignored: the run directory already has checkpoint 2" in err


def test_the_plain_progress_eta_leaves_out_the_first_steps_compile(monkeypatch):
    import io

    from olmax.metrics import sinks

    clock = iter([0.0, 100.0, 109.0])  # constructed; step 1 done (after a 100 s compile); step 10 done
    monkeypatch.setattr(sinks.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = sinks.ProgressBar(20, 0, every=10, file=out)  # t0 = 0; step 1 done at 100 s (compile)
    for s in range(1, 11):
        bar.update(s)
    line = out.getvalue().splitlines()[0]  # step 10 at 109 s: 1 s a step since step 1
    assert line.startswith("step 10/20") and "eta 0:00:10" in line, line
