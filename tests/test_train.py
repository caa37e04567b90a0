"""The training loop: numbering, exact resume, elastic resume, warm starts, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmax.checkpoint.load import restore_train_state
from olmax.checkpoint.store import Checkpointer
from olmax.config import ConfigError
from olmax.recipes import get_recipe
from olmax.train.loop import train
from olmax.verify.resume import read_metrics
from trainlib import small_overrides, write_corpus


def cfg_for(paths, *extra):
    return get_recipe("tiny", small_overrides(paths, *extra))


def test_trains_logs_and_checkpoints(tmp_path, corpus):
    cfg = cfg_for(corpus, "train.steps=5")
    res = train(cfg, tmp_path / "run", progress=False)
    assert res.start_step == 0 and res.end_step == 5 and sorted(res.losses) == [1, 2, 3, 4, 5]
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for name in ("train/CE loss", "train/Z loss", "optim/total grad norm", "optim/LR (group 0)",
                 "optim/step skipped", "throughput/total tokens", "throughput/device/TPS"):
        assert name in rows[0], name
    # Each value once, under OLMo-core's name (compare reads the MaxText run's names under them).
    assert "optim/step_skipped" not in rows[0] and "perf/total_tokens" not in rows[0]
    assert rows[-1]["throughput/total tokens"] == 5 * 8 * 16
    assert rows[0]["optim/LR (group 0)"] == pytest.approx(cfg.optim.lr / cfg.optim.schedule.warmup)
    # Interval 2 plus the final step, of which the tiny recipe keeps the last 2.
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint, read_only=True)
    assert ck.all_steps() == [4, 5]
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "run_info.json").exists()
    # The loss falls on this learnable corpus.
    assert res.losses[5] < res.losses[1]


@pytest.mark.integration  # a whole training run: `make test` stays under 8 minutes
def test_checkpoint_n_is_state_after_n_updates_and_resumes_with_batch_n(tmp_path, corpus):
    """The published off-by-one: checkpoint N must pair the state after N updates with data
    position N, so the resumed run trains global batch N next."""
    cfg = cfg_for(corpus, "train.steps=4")
    train(cfg, tmp_path / "a", progress=False)
    params, opt, _, meta = restore_train_state(tmp_path / "a" / "checkpoints" / "2")
    assert int(opt.step) == 2 and int(opt.adam_step) == 2 and meta["step"] == 2
    assert meta["data_state"]["batches_processed"] == 2
    # Stop after 2 updates, resume in the same process: the losses of steps 3 and 4 equal those of
    # the uninterrupted run only if batch index 2 is trained third.
    first = train(cfg, tmp_path / "b", progress=False, max_steps_this_run=2)
    assert first.stopped_early and first.end_step == 2
    second = train(cfg, tmp_path / "b", progress=False)
    assert second.start_step == 2
    full = read_metrics(tmp_path / "a")
    resumed = read_metrics(tmp_path / "b")
    assert [resumed[s]["train/CE loss"] for s in (1, 2, 3, 4)] == [full[s]["train/CE loss"] for s in (1, 2, 3, 4)]


@pytest.mark.integration
def test_gradient_accumulation_matches_one_big_batch(tmp_path, corpus):
    a = train(cfg_for(corpus, "train.steps=3"), tmp_path / "a", progress=False)
    b = train(cfg_for(corpus, "train.steps=3", "train.micro_batch_size=2"), tmp_path / "b", progress=False)
    for s in (1, 2, 3):
        assert b.losses[s] == pytest.approx(a.losses[s], abs=1e-5)


@pytest.mark.integration  # a whole training run: `make test` stays under 8 minutes
def test_resume_with_a_changed_dataset_is_an_error(tmp_path, corpus):
    cfg = cfg_for(corpus, "train.steps=4")
    train(cfg, tmp_path / "run", progress=False, max_steps_this_run=2)
    extra = Path(write_corpus(tmp_path / "more", n_files=1, seed=5)[0])
    extra = str(extra.rename(extra.with_name("extra.npy")))
    cfg2 = cfg_for(corpus + [extra], "train.steps=4")
    with pytest.raises(ValueError, match="files added: extra.npy"):
        train(cfg2, tmp_path / "run", progress=False)
    # Nothing written was lost: the checkpoint is still there and still resumes.
    assert Checkpointer(tmp_path / "run", cfg.checkpoint, read_only=True).latest_step() == 2
    assert train(cfg, tmp_path / "run", progress=False).end_step == 4


@pytest.mark.integration  # a whole training run: `make test` stays under 8 minutes
def test_resume_with_a_different_model_is_an_error(tmp_path, corpus):
    train(cfg_for(corpus, "train.steps=2"), tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match="model.d_model"):
        train(cfg_for(corpus, "train.steps=4", "model.d_model=48"), tmp_path / "run", progress=False)


def test_indivisible_batch_is_an_error_before_compiling(tmp_path, corpus):
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide"):
        train(cfg_for(corpus, "train.micro_batch_size=3"), tmp_path / "run", progress=False)


@pytest.mark.integration
def test_stage2_style_warm_start_keeps_moments_and_resets_step(tmp_path, corpus):
    train(cfg_for(corpus, "train.steps=3"), tmp_path / "s1", progress=False)
    _, opt1, _, _ = restore_train_state(tmp_path / "s1")
    cfg2 = cfg_for(corpus, "train.steps=1", "optim.schedule.name=linear", "optim.schedule.warmup=0",
                   "optim.schedule.alpha_f=0",
                   "data.seed=1337", f"train.init_from=state:{tmp_path / 's1'}")
    res = train(cfg2, tmp_path / "s2", progress=False)
    rows = read_metrics(tmp_path / "s2")
    # Step reset: linear schedule at step 1 of 1 without warmup is lr * (1 - 1/1) = 0.
    assert rows[1]["optim/LR (group 0)"] == pytest.approx(0.0, abs=1e-12)
    _, opt2, _, _ = restore_train_state(tmp_path / "s2")
    assert int(opt2.step) == 1 and int(opt2.adam_step) == int(opt1.adam_step) + 1
    # With lr 0 the moments still advance from stage 1's, not from zero.
    m1 = np.asarray(opt1.mu["lm_head"])
    m2 = np.asarray(opt2.mu["lm_head"])
    assert np.abs(m1).max() > 0 and not np.allclose(m2, 0) and res.end_step == 1
    with pytest.raises(ConfigError, match="expected 'hf:DIR'"):
        train(cfg_for(corpus, "train.init_from=bogus"), tmp_path / "s3", progress=False)


def _cli_train(run_dir: Path, overrides: list[str], devices: int, max_steps: int | None = None):
    return subprocess.run(
        [sys.executable, "-m", "olmax.cli", "train", "tiny", "--run-dir", str(run_dir), "--no-progress",
         *sum((["--set", o] for o in overrides), [])] + (["--max-steps-this-run", str(max_steps)] if max_steps else []),
        env={**__import__("os").environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
             "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)


@pytest.mark.integration
def test_resume_ab_is_bitwise_with_two_loader_workers(tmp_path, corpus):
    """``olmax verify resume`` end to end: uninterrupted vs interrupted + resumed in a new process."""
    cmd = [sys.executable, "-m", "olmax.cli", "verify", "resume", "tiny", "--steps", "6", "--interrupt-at", "3",
           "--out", str(tmp_path / "ab"), "--json"]
    for o in small_overrides(corpus, "data.workers=2", "checkpoint.keep_last=10"):
        cmd += ["--set", o]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["ok"] and res["steps"] == 6 and res["max_abs_ce_diff"] == 0.0 and res["tolerance"] == 0.0
    assert res["first_difference"] is None and res["interrupt_at"] == 3
    # The interrupted run really stopped at 3 and resumed: its checkpoints include step 3.
    assert (tmp_path / "ab" / "resumed" / "checkpoints" / "3").is_dir()


@pytest.mark.integration
def test_sigterm_checkpoints_and_the_resumed_run_matches(tmp_path, corpus):
    """SIGTERM mid-run: the loop saves a checkpoint and exits 0; rerunning the same command
    finishes with exactly the losses of an uninterrupted run."""
    import signal
    import time
    ov = small_overrides(corpus, "train.steps=3000", "checkpoint.interval=100000")
    cmd = [sys.executable, "-m", "olmax.cli", "train", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for o in ov:
        cmd += ["--set", o]
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "stopped early" in err
    ck = Checkpointer(tmp_path / "run", get_recipe("tiny", ov).checkpoint, read_only=True)
    stopped_at = ck.latest_step()
    assert stopped_at is not None and 5 <= stopped_at < 3000
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert rows[-1]["step"] == stopped_at
    # Resume for 3 more updates (same schedule horizon) and compare with an uninterrupted run.
    end = stopped_at + 3
    r = subprocess.run(cmd + ["--max-steps-this-run", "3"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    train(get_recipe("tiny", ov), tmp_path / "straight", progress=False, max_steps_this_run=end)
    got, want = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "straight")
    assert sorted(got) == list(range(1, end + 1))
    assert [got[s]["train/CE loss"] for s in sorted(got)] == [want[s]["train/CE loss"] for s in sorted(got)]


@pytest.mark.integration
def test_elastic_resume_from_4_devices_to_1(tmp_path, corpus):
    from olmax.verify.resume import verify_resume
    ov = small_overrides(corpus)
    res = verify_resume("tiny", ov, steps=6, interrupt_at=3, workdir=tmp_path, devices_before=4, devices_after=1,
                        tol=1e-5)
    assert res["ok"], res
    # The interrupted run really did change topology.
    info = json.loads((tmp_path / "resumed" / "run_info.json").read_text())
    assert info["devices"] == 4


@pytest.mark.integration
def test_in_loop_memorisation_alarm_fires_on_repeated_data(tmp_path, capfd):
    """A run that sees the same few instances again and again beats the honest reference on
    training loss while its held-out loss does not improve: the loop must say so."""
    corpus = write_corpus(tmp_path / "c", n_files=2, tokens_per_file=6000, seed=1)
    heldout = write_corpus(tmp_path / "h", n_files=1, tokens_per_file=2000, seed=2)
    common = ["train.steps=40", "eval.interval=20", "eval.batches=4", "eval.batch_size=8", "optim.lr=1e-2",
              "optim.skip_step.enabled=false", f"eval.heldout_paths={heldout[0]}", "checkpoint.interval=1000"]
    train(cfg_for(corpus, *common), tmp_path / "honest", progress=False)
    # The repeated-data bug: one 256-token file (2 global batches) listed 20 times.
    small = Path(tmp_path / "small.npy")
    np.fromfile(corpus[0], dtype="<u2")[:256].tofile(small)
    bugged = cfg_for([str(small)] * 20, *common, f"eval.reference={tmp_path / 'honest'}")
    train(bugged, tmp_path / "bugged", progress=False)
    err = capfd.readouterr().err
    assert "MEMORISATION ALARM" in err
    rows = [json.loads(l) for l in (tmp_path / "bugged" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("eval/memorisation alarm") == 1.0 for r in rows)
    # The honest run compared with itself stays quiet.
    quiet = cfg_for(corpus, *common, f"eval.reference={tmp_path / 'honest'}")
    train(quiet, tmp_path / "again", progress=False)
    assert "MEMORISATION ALARM" not in capfd.readouterr().err


def test_bad_data_fails_before_anything_is_built(tmp_path, corpus):
    missing = str(tmp_path / "nope.npy")
    with pytest.raises(ValueError, match="nope.npy"):
        train(cfg_for([missing]), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "config.yaml").exists()
    with pytest.raises(ValueError, match="token file not found: .*gone.npy"):
        train(cfg_for(corpus, f"eval.heldout_paths={tmp_path / 'gone.npy'}"), tmp_path / "run2", progress=False)
    assert not (tmp_path / "run2" / "config.yaml").exists()


@pytest.mark.integration
def test_heldout_paths_take_a_tokenize_folder(tmp_path, corpus):
    """eval.heldout_paths accepts what data.paths accepts, e.g. the heldout/ folder of `olmax tokenize`."""
    held = tmp_path / "heldout"
    files = write_corpus(held, n_files=1, tokens_per_file=2000, seed=4)
    (held / "manifest.json").write_text(json.dumps({"dtype": "uint16", "eos_token_id": 0, "vocab_size": 256,
                                                    "files": [{"path": Path(files[0]).name, "tokens": 2000}]}))
    by_folder = train(cfg_for(corpus, "train.steps=2", "eval.interval=2", f"eval.heldout_paths={held}"),
                      tmp_path / "a", progress=False)
    by_file = train(cfg_for(corpus, "train.steps=2", "eval.interval=2", f"eval.heldout_paths={files[0]}"),
                    tmp_path / "b", progress=False)
    ev = [[json.loads(l) for l in (tmp_path / r / "metrics.jsonl").read_text().splitlines()
           if "eval/heldout/CE loss" in l] for r in ("a", "b")]
    assert by_folder.end_step == by_file.end_step == 2
    assert ev[0] and ev[0][-1]["eval/heldout/CE loss"] == ev[1][-1]["eval/heldout/CE loss"]


@pytest.mark.integration
def test_hf_warm_start_train_export_and_parity(tmp_path, corpus):
    """HF weights -> olmax training (--init-from hf:) -> export of the trained checkpoint back to HF
    -> logit parity of the export against the checkpoint itself, through the CLI."""
    from olmax.compat.hf import random_hf_model
    hf = random_hf_model(tmp_path / "hf", seed=3, vocab_size=256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         sliding_window=8, max_position_embeddings=4096, rms_norm_eps=1e-6,
                         eos_token_id=0, pad_token_id=1, bos_token_id=None)
    # HF pads nothing here: the recipe's vocabulary must match the checkpoint's, as it does.
    cfg = cfg_for(corpus, "train.steps=3", f"train.init_from=hf:{hf}", "model.padded_vocab_size=256",
                  "data.eos_token_id=0", "data.pad_token_id=1")
    res = train(cfg, tmp_path / "run", progress=False)
    assert res.end_step == 3
    cli = [sys.executable, "-m", "olmax.cli"]
    r = subprocess.run(cli + ["convert", "olmax-to-hf", "--checkpoint", str(tmp_path / "run"), "--out",
                              str(tmp_path / "export")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(cli + ["parity", "--hf", str(tmp_path / "export"), "--checkpoint", str(tmp_path / "run"),
                              "--seq-len", "24", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["kl_max"] <= 1e-7 and rep["top1_agreement"] == 1.0 and rep["max_abs_logit_diff"] <= 1e-4
    # The trained weights moved away from the HF initial weights (the export is not the input).
    import safetensors.numpy as stn
    a = stn.load_file(str(hf / "model.safetensors"))["lm_head.weight"]
    b = stn.load_file(str(tmp_path / "export" / "model.safetensors"))["lm_head.weight"]
    assert a.shape == b.shape and not np.array_equal(a, b)
    # The export streams the checkpoint's parameters, restored without the Adam moments, bit for bit.
    params, opt, _, _ = restore_train_state(tmp_path / "run", params_only=True)
    assert opt is None
    np.testing.assert_array_equal(b, np.asarray(params["lm_head"]).T)
    # Exporting again into the now non-empty directory is refused and leaves it intact.
    r = subprocess.run(cli + ["convert", "olmax-to-hf", "--checkpoint", str(tmp_path / "run"), "--out",
                              str(tmp_path / "export")], capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr
    assert (tmp_path / "export" / "model.safetensors").exists()
