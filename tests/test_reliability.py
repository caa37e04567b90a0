"""Nothing non-finite or corrupt is trained on, saved over good state, or loaded silently.

One section per way it could happen; the end-to-end fault injections (kill -9,
flipped bits, full disk) are in test_fault_injection.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax import cli
from olmax.checkpoint.load import restore_train_state
from olmax.checkpoint.store import Checkpointer
from olmax.config import ConfigError, OptimConfig, ScheduleConfig, SkipStepConfig
from olmax.data import DataError
from olmax.data.dataset import CONTENT_RANGE_BYTES, CONTENT_RANGES, TokenDataset, validate_tokens
from olmax.data.loader import DataLoader, DataState
from olmax.optim import apply_update, init_opt_state
from olmax.recipes import get_recipe
from olmax.train.loop import NONFINITE_METRIC, NonFiniteError, all_finite, train
from olmax.verify.resume import read_metrics
from trainlib import small_overrides, write_corpus


def cfg_for(paths, *extra):
    return get_recipe("tiny", small_overrides(paths, *extra))


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "olmax.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


@pytest.fixture
def olmax_main(monkeypatch, capsys):
    """``olmax ARGS`` in this process: (exit status, stdout, stderr). The hooks and log levels the
    CLI sets are put back afterwards."""
    import logging
    import threading
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    levels = {n: logging.getLogger(n).level for n in ("absl", "orbax", "jax._src.distributed", "grain", "asyncio")}

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        rc = cli.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)
    yield run
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def sets(overrides: list[str]) -> list[str]:
    return sum((["--set", o] for o in overrides), [])


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The error contract: exit 2, one ``error:`` line on stderr, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


# --------------------------------------------------------------------------- out-of-vocabulary ids


@pytest.mark.integration
def test_out_of_vocab_ids_deep_in_a_file_stop_before_the_update(tmp_path):
    """Ids >= vocab outside the sampled validation windows: the instance is checked as read and
    the error names the file, the token offset and the global step of the batch."""
    n, vocab, L = 200_000, 256, 16
    x = np.random.default_rng(0).integers(0, vocab, n).astype("<u2")
    starts = sorted({int(s) for s in np.linspace(0, n - (1 << 14), 8)})
    lo, hi = starts[0] + (1 << 14) + 100, starts[1] - 100          # between two sampled windows
    x[lo:hi] = 5000
    path = tmp_path / "oov.npy"
    x.tofile(path)
    validate_tokens(str(path), "uint16", vocab)                   # the construction-time sample misses it
    cfg = cfg_for([str(path)], "train.steps=200")
    # The first step whose batch holds a bad instance, from the data order itself.
    loader = DataLoader(cfg, cache_dir=tmp_path / "cache")
    def bad(i: int) -> bool:
        return lo < (i + 1) * L and i * L < hi
    first = next(k for k in range(200) if any(bad(int(i)) for i in loader.source.ids(k)))
    first_bad = next(int(i) for i in loader.source.ids(first) if bad(int(i)))   # rows are read in order
    offset = max(lo, first_bad * L)
    with pytest.raises(DataError) as err:
        train(cfg, tmp_path / "run", progress=False)
    msg = str(err.value)
    assert str(path) in msg and f"global batch {first} (" in msg and "token id 5000" in msg
    assert f"token offset {offset} " in msg
    # Nothing trained on it: every checkpoint is from before that batch and finite.
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint, read_only=True)
    assert all(s <= first for s in ck.all_steps())
    if ck.all_steps():
        params, opt, _, _ = restore_train_state(tmp_path / "run")
        assert bool(all_finite((params, opt.mu, opt.nu)))


# --------------------------------------------------------------------------- learning rate, divergence


@pytest.mark.parametrize("lr", ["nan", "inf", "-1e-3", "-inf"])
def test_non_finite_or_negative_lr_is_rejected(lr, corpus):
    with pytest.raises(ConfigError, match="optim.lr must be a finite number"):
        cfg_for(corpus, f"optim.lr={lr}")


@pytest.mark.integration
def test_diverging_run_stops_nonzero_and_keeps_the_last_finite_checkpoint(tmp_path, corpus):
    """lr=1e6 turns the loss NaN within a few steps: those updates are skipped from step 1,
    logged, the run stops after max_nonfinite_steps, and keep_last rotation keeps the finite
    checkpoint (nothing non-finite is ever written)."""
    run = tmp_path / "run"
    train(cfg_for(corpus, "train.steps=4", "checkpoint.keep_last=1"), run, progress=False)
    cfg = cfg_for(corpus, "train.steps=40", "checkpoint.keep_last=1", "checkpoint.interval=1", "optim.lr=1e6",
                  "optim.skip_step.max_nonfinite_steps=3")
    with pytest.raises(NonFiniteError, match="3 consecutive updates had a non-finite"):
        train(cfg, run, progress=False)
    rows = read_metrics(run)
    bad = [s for s in sorted(rows) if rows[s][NONFINITE_METRIC] == 1.0]
    assert len(bad) >= 3 and all(rows[s]["optim/step skipped"] == 1.0 for s in bad)
    assert bad[-3:] == list(range(bad[-3], bad[-3] + 3)) and max(rows) < 40
    ck = Checkpointer(run, cfg.checkpoint, read_only=True)
    steps = ck.all_steps()
    assert steps and all(s < bad[0] for s in steps), (steps, bad)
    params, opt, _, _ = restore_train_state(run)
    assert bool(all_finite((params, opt.mu, opt.nu)))


# --------------------------------------------------------------------------- non-finite losses


def _tiny_params():
    rng = np.random.default_rng(0)
    return {"embed": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
            "w": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)}


def _run_updates(losses, cfg: OptimConfig):
    params = _tiny_params()
    state = init_opt_state(params, cfg)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
    skipped = []
    for loss in losses:
        g = jax.tree.map(lambda x: x * np.float32(loss) if np.isfinite(loss) else x * np.nan, grads)
        params, state, m = apply_update(params, g, state, jnp.float32(loss), optim_cfg=cfg, total_steps=100)
        skipped.append(bool(m["step_skipped"]))
    return params, state, skipped


def test_a_nan_never_enters_the_history_and_the_switch_replays_olmo_core():
    window = 8
    losses = [2.0 + 0.01 * (i % 3) for i in range(12)] + [float("nan")] + [2.0 + 0.01 * (i % 3) for i in range(12)]
    base = dict(lr=1e-3, schedule=ScheduleConfig(name="constant", warmup=0))
    ours = OptimConfig(**base, skip_step=SkipStepConfig(window=window, min_history=4))
    ref = OptimConfig(**base, skip_step=SkipStepConfig(window=window, min_history=4, olmo_core_nonfinite=True))
    p, state, skipped = _run_updates(losses, ours)
    assert [i + 1 for i, s in enumerate(skipped) if s] == [13]          # only the NaN step
    assert np.all(np.isfinite(np.asarray(state.loss_history))) and int(state.history_count) == window
    assert bool(all_finite(p))
    _, ref_state, ref_skipped = _run_updates(losses, ref)
    # OLMo-core: the NaN stays in the history, so the next `window` updates are skipped too.
    assert [i + 1 for i, s in enumerate(ref_skipped) if s] == list(range(13, 13 + window + 1))


def test_non_finite_is_skipped_from_step_1_whatever_min_history():
    cfg = OptimConfig(lr=1e-3, skip_step=SkipStepConfig(window=8, min_history=64))
    p, state, skipped = _run_updates([float("inf"), 2.0, 2.0], cfg)
    assert skipped == [True, False, False] and int(state.adam_step) == 2 and int(state.history_count) == 2
    assert bool(all_finite((p, state.mu, state.nu)))
    ref = OptimConfig(lr=1e-3, skip_step=SkipStepConfig(window=8, min_history=64, olmo_core_nonfinite=True))
    p, _, skipped = _run_updates([float("inf"), 2.0], ref)
    assert skipped == [False, False] and not bool(all_finite(p))        # what OLMo-core 3.0.0 does


# --------------------------------------------------------------------------- error contract


def test_yaml_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1,\n")
    # In a real process once: exit status, stderr and no traceback as a user sees them.
    assert_one_line_error(run_cli("print-config", str(bad)), str(bad), "not valid YAML at line")


@pytest.mark.parametrize("override", ["train.log_interval=0", "eval.interval=0"])
def test_zero_intervals_fail_before_compiling(override, tmp_path, corpus, olmax_main):
    r = olmax_main("train", "tiny", "--run-dir", str(tmp_path / "run"), *sets(small_overrides(corpus, override)))
    assert_one_line_error(r, override.split("=")[0], "must be positive")
    assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback_and_bugs_keep_theirs(tmp_path, monkeypatch, olmax_main):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    monkeypatch.setenv("OLMAX_DEBUG", "1")
    r = olmax_main("print-config", str(bad))
    assert r.returncode == 2 and "Traceback" in r.stderr and "error: " in r.stderr
    monkeypatch.delenv("OLMAX_DEBUG")
    assert "Traceback" not in olmax_main("print-config", str(bad)).stderr
    r = olmax_main("--debug", "print-config", str(bad))
    assert r.returncode == 2 and "Traceback" in r.stderr

    # An internal bug (not a user error) is not turned into a one-liner.
    import olmax.commands as commands

    def boom(args):
        raise KeyError("internal")
    monkeypatch.setattr(commands, "cmd_print_config", boom)
    with pytest.raises(KeyError):
        cli.main(["print-config", "tiny"])


def test_config_keys_that_are_not_names_are_unknown_keys(tmp_path, olmax_main):
    """YAML reads `1:`, `true:` and `null:` as a number, a boolean and None: still an unknown key."""
    bad = tmp_path / "e.yaml"
    bad.write_text("name: tiny\n1: 2\n")
    assert_one_line_error(olmax_main("print-config", str(bad)), str(bad), "unknown config key '1'")
    assert_one_line_error(olmax_main("print-config", "tiny", "--set", "model={1: 2}"), "unknown config key 'model.1'")
    assert_one_line_error(olmax_main("inspect", "tiny", "--set", "optim.schedule={true: 1}"),
                          "unknown config key 'optim.schedule.True'")


def test_a_failed_rename_names_the_file_the_user_named():
    # os.replace(tmp, target) fails with both names; the one to report is the target.
    e = OSError(21, "Is a directory", ".out.tmp123", None, "out")
    assert cli._user_error_message(e) == "Is a directory: out (renaming .out.tmp123 to it)"
    assert cli._user_error_message(FileNotFoundError(2, "No such file or directory", "x.npy")) == \
        "No such file or directory: x.npy"


def test_an_atomic_write_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from olmax import io
    out = tmp_path / "out.txt"
    io.write_local_atomically(out, "first")
    assert out.read_text() == "first"

    def half_then_fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        io.write_local_atomically(out, half_then_fail)
    assert out.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    io.write_local_atomically(out, b"second")
    assert out.read_bytes() == b"second"


def test_launch_output_files_are_checked_and_a_users_file_is_never_replaced(tmp_path, olmax_main):
    data = tmp_path / "tok.bin"
    data.write_bytes(b"\1\0" * 1000)
    run = ["--run-dir", str(tmp_path / "run")]
    # launch local: a status file that cannot be written fails before any trainer starts.
    r = olmax_main("launch", "local", "tiny", *run, "--status-file", str(tmp_path))
    assert_one_line_error(r, f"--status-file {tmp_path}: is a folder")
    r = olmax_main("launch", "local", "tiny", *run, "--status-file", str(tmp_path / "no" / "s.json"))
    assert_one_line_error(r, "--status-file", "does not exist")
    assert_one_line_error(olmax_main("launch", "local", "tiny", *run, "--status-file", str(data)),
                          "not written by olmax launch")
    assert not (tmp_path / "run").exists()
    # launch tpu --manifest: never over a file olmax did not write; its own manifest is rewritten.
    assert_one_line_error(olmax_main("launch", "tpu", "tiny", *run, "--manifest", str(data)),
                          f"--manifest {data}", "not written by olmax launch")
    assert data.read_bytes() == b"\1\0" * 1000
    manifest = tmp_path / "jobset.yaml"
    for hosts in ("2", "4"):
        assert olmax_main("launch", "tpu", "tiny", *run, "--hosts", hosts, "--manifest", str(manifest)).returncode == 0
    assert "4 hosts" in manifest.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobset.yaml", "tok.bin"]  # no temporary file left
    # launch slurm --out: the same rule (checked before sbatch is looked for).
    assert_one_line_error(olmax_main("launch", "slurm", "tiny", *run, "--nodes", "1", "--gpus-per-node", "0",
                                     "--out", str(data)), f"--out {data}", "not written by olmax launch")


def test_json_errors(tmp_path, olmax_main):
    r = olmax_main("eval", "loss", "--checkpoint", str(tmp_path / "nope"), "--data", str(tmp_path / "x.npy"), "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error" in json.loads(r.stdout)


# --------------------------------------------------------------------------- nonsense values


@pytest.mark.parametrize("override,field", [
    ("train.micro_batch_size=0", "train.micro_batch_size"), ("optim.schedule.t_max=0", "optim.schedule.t_max"),
    ("data.workers=-1", "data.workers"), ("eval.batches=0", "eval.batches"),
    ("optim.skip_step.max_nonfinite_steps=0", "optim.skip_step.max_nonfinite_steps"),
    ("optim.beta2=1.0", "optim.beta2"), ("optim.eps=0", "optim.eps"),
])
def test_nonsense_values_are_errors_naming_the_field(override, field, corpus):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg_for(corpus, override)


@pytest.mark.integration
def test_max_steps_zero_and_steps_below_the_checkpoint(tmp_path, corpus):
    with pytest.raises(ConfigError, match="--max-steps-this-run must be positive"):
        train(cfg_for(corpus), tmp_path / "a", progress=False, max_steps_this_run=0)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    train(cfg_for(corpus, "train.steps=4"), tmp_path / "b", progress=False)
    with pytest.raises(ConfigError, match="train.steps=2 is below checkpoint 4"):
        train(cfg_for(corpus, "train.steps=2"), tmp_path / "b", progress=False)


# --------------------------------------------------------------------------- edited token files


def _edit_same_size(path: Path, at: int) -> None:
    x = np.fromfile(path, "<u2")
    x[at] = (x[at] + 1) % 256
    x.tofile(path)


@pytest.mark.integration
def test_same_size_edit_is_caught_on_resume_and_names_the_file_and_flag(tmp_path, corpus):
    cfg = cfg_for(corpus, "train.steps=4")
    train(cfg, tmp_path / "run", progress=False, max_steps_this_run=2)
    _edit_same_size(Path(corpus[1]), 1234)
    with pytest.raises(DataError) as err:
        train(cfg, tmp_path / "run", progress=False)
    assert corpus[1] in str(err.value) and "--allow-fingerprint-mismatch" in str(err.value)
    res = train(cfg, tmp_path / "run", progress=False, allow_fingerprint_mismatch=True)
    assert res.end_step == 4
    # The content fingerprint can be switched off (names and sizes only, as OLMo-core).
    off = cfg_for(corpus, "train.steps=4", "data.content_fingerprint=false")
    state = DataLoader(off, cache_dir=tmp_path / "cache").state()
    assert state.content == []
    _edit_same_size(Path(corpus[0]), 10)
    assert DataLoader(off, resume=state, cache_dir=tmp_path / "cache").start_step == 0
    # ... while on (the default) the same state with recorded contents is checked.
    recorded = DataState(**{**state.to_dict(), "content": [[os.path.basename(p), "0" * 64] for p in corpus]})
    with pytest.raises(DataError, match="contents changed"):
        DataLoader(cfg, resume=recorded, cache_dir=tmp_path / "cache")


def test_large_files_are_sampled(tmp_path):
    """Above 1 MiB only sampled ranges are read: an edit in one is caught, the hash stays cheap."""
    n = 3 << 20                                             # 6 MiB of uint16
    x = np.random.default_rng(1).integers(0, 256, n).astype("<u2")
    path = tmp_path / "big.npy"
    x.tofile(path)
    ds = TokenDataset([str(path)], sequence_length=16, vocab_size=256, eos_token_id=0, pad_token_id=1,
                      dtype="uint16", validate="none")
    before = ds.content_hashes
    size = path.stat().st_size
    sampled = int(np.linspace(0, size - CONTENT_RANGE_BYTES, CONTENT_RANGES).astype(np.int64)[5])
    _edit_same_size(path, sampled // 2 + 7)
    after = TokenDataset([str(path)], sequence_length=16, vocab_size=256, eos_token_id=0, pad_token_id=1,
                         dtype="uint16", validate="none").content_hashes
    assert before != after and before[0][0] == "big.npy"
    assert ds.fingerprint == TokenDataset([str(path)], sequence_length=16, vocab_size=256, eos_token_id=0,
                                          pad_token_id=1, dtype="uint16", validate="none").fingerprint


# --------------------------------------------------------------------------- never overwritten


def test_compare_refuses_a_non_empty_out(tmp_path, olmax_main):
    run = tmp_path / "metrics.jsonl"
    run.write_text("".join(json.dumps({"step": s, "train/CE loss": 5.0 - 0.1 * s}) + "\n" for s in range(1, 9)))
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("an earlier report\n")
    r = olmax_main("compare", str(tmp_path / "run"), "--out", str(out))
    assert_one_line_error(r, str(out), "not empty")
    assert (out / "report.md").read_text() == "an earlier report\n" and len(list(out.iterdir())) == 1


@pytest.mark.integration
def test_binary_metrics_file_is_named_and_left_untouched(tmp_path, corpus):
    cfg = cfg_for(corpus, "train.steps=4")
    train(cfg, tmp_path / "run", progress=False, max_steps_this_run=2)
    metrics = tmp_path / "run" / "metrics.jsonl"
    junk = bytes(range(256)) * 4 + b"\n" + os.urandom(100)
    metrics.write_bytes(junk)
    with pytest.raises(ValueError) as err:
        train(cfg, tmp_path / "run", progress=False)
    assert str(metrics) in str(err.value) and "not a JSON-lines text file" in str(err.value)
    assert metrics.read_bytes() == junk


# --------------------------------------------------------------------------- messages


def test_messages_name_the_flag_and_the_file(tmp_path, corpus, olmax_main):
    # The fingerprint error names the flag, not the Python keyword. (5 steps: test_train's run, whose
    # compiled step then loads from the persistent cache in one or the other.)
    cfg = cfg_for(corpus, "train.steps=5")
    train(cfg, tmp_path / "run", progress=False, max_steps_this_run=2)
    extra = write_corpus(tmp_path / "more", n_files=1, seed=3)
    r = olmax_main("train", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress",
                   *sets(small_overrides(corpus + extra, "train.steps=5")))
    line = assert_one_line_error(r, "--allow-fingerprint-mismatch")
    assert "allow_fingerprint_mismatch=True" not in line
    # An unreadable checkpoint meta JSON is named (and, being the only one, a one-line error).
    (tmp_path / "run" / "checkpoints" / "2" / "meta" / "metadata").write_text("{not json")
    r = olmax_main("eval", "loss", "--checkpoint", str(tmp_path / "run" / "checkpoints" / "2"), "--data", corpus[0])
    assert_one_line_error(r, str(tmp_path / "run" / "checkpoints" / "2"), "meta")
    # A run directory that is a file.
    f = tmp_path / "file"
    f.write_text("x")
    r = olmax_main("train", "tiny", "--run-dir", str(f), *sets(small_overrides(corpus)))
    line = assert_one_line_error(r, str(f), "is a file, not a directory")
    assert "Errno" not in line
