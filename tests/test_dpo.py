"""DPO (olmax.objectives.dpo): the loss against a numpy formula, per-sequence log-probs against the
model's logits, the reference-log-prob cache (fingerprint, resume, errors), a tiny `olmax train`
run that resumes bit for bit, and parity with TRL 1.16's DPOTrainer (olmax.verify.trl)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ConfigError
from olmax.data.chat import write_pairs
from olmax.objectives.dpo import PairSet, ReferenceCache, dpo_terms, read_pairs, sequence_logps, step_pairs
from olmax.recipes import get_recipe
from olmax.verify.trl import PARITY_OVERRIDES, make_pairs

SMALL = [o for o in PARITY_OVERRIDES if not o.startswith(("optim.", "dpo."))]


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("loss", ["dpo_norm", "dpo"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_and_rewards_match_a_numpy_formula(loss, smoothing):
    rng = np.random.default_rng(0)
    k, beta = 6, 5.0
    pi = rng.normal(-40, 10, (k, 2)).astype(np.float32)
    ref = rng.normal(-40, 10, (k, 2)).astype(np.float32)
    n = rng.integers(1, 30, (k, 2)).astype(np.float32)
    n[0, 1] = 0  # a fully truncated response: its mean is over max(n, 1) tokens (TRL's clamp)
    t = dpo_terms(jnp.asarray(pi), jnp.asarray(ref), jnp.asarray(n), loss=loss, beta=beta, label_smoothing=smoothing)
    p64, r64, n64 = pi.astype(np.float64), ref.astype(np.float64), np.maximum(n, 1).astype(np.float64)
    if loss == "dpo_norm":
        p64, r64 = p64 / n64, r64 / n64
    x = (p64[:, 0] - p64[:, 1]) - (r64[:, 0] - r64[:, 1])
    want = -(1 - smoothing) * _log_sigmoid(beta * x) - smoothing * _log_sigmoid(-beta * x)
    np.testing.assert_allclose(np.asarray(t["losses"]), want, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(t["rewards"]), beta * (p64 - r64), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(t["summed_rewards"]), beta * (pi.astype(np.float64) - ref), rtol=1e-5,
                               atol=1e-3)


def test_sequence_logps_are_the_masked_target_log_probs_of_the_logits():
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params
    cfg = get_recipe("tiny_dpo", [*SMALL, "model.logits_chunk=7"])  # chunks that do not divide the length
    params = init_params(cfg.model, jax.random.key(0))
    rng = np.random.default_rng(1)
    toks = rng.integers(2, cfg.model.vocab_size, (3, 2, 20)).astype(np.int32)
    mask = rng.random((3, 2, 20)) < 0.6
    # Each compiled whole (op by op, each of their ~50 operations compiles on its own).
    s, n = jax.jit(lambda p, t, m: sequence_logps(p, t, m, cfg))(params, jnp.asarray(toks), jnp.asarray(mask))
    logits = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg.model))(params, jnp.asarray(toks.reshape(6, 20))),
                        np.float64)
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1,
                                                                                                           keepdims=True)
    flat_t, flat_m = toks.reshape(6, 20), mask.reshape(6, 20)
    want = np.array([sum(lp[b, i, flat_t[b, i + 1]] for i in range(19) if flat_m[b, i + 1]) for b in range(6)])
    np.testing.assert_allclose(np.asarray(s).reshape(6), want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(n).reshape(6), flat_m[:, 1:].sum(1))


def test_pair_files_round_trip_and_order_is_a_seeded_permutation(tmp_path):
    pairs = make_pairs(10, 512, 64, 0, eos=0, pad=1)
    folder = write_pairs(tmp_path / "pairs", pairs)
    tokens, mask, index = read_pairs(folder)
    assert index.shape == (10, 4) and tokens.dtype == np.uint32 and mask.dtype == bool
    ps = PairSet(folder, 64, pad_id=1)
    toks, m = ps.rows(np.array([3]))
    c, cm, r, rm = pairs[3]
    assert toks[0, 0, :len(c)].tolist() == c and m[0, 1, :len(r)].tolist() == rm
    assert (toks[0, 0, len(c):] == 1).all() and not m[0, 0, len(c):].any()
    ep0 = np.concatenate([step_pairs(10, 7, 3, s) for s in range(3)])
    assert len(set(ep0.tolist())) == 9                              # one epoch: each pair at most once
    assert not np.array_equal(step_pairs(10, 7, 3, 0), step_pairs(10, 7, 3, 3))  # reshuffled next epoch
    with pytest.raises(ConfigError, match="pairs_index.npy"):
        (folder / "pairs_index.npy").unlink()
        read_pairs(folder)


def _cfg(tmp_path: Path, *extra: str):
    pairs = write_pairs(tmp_path / "pairs", make_pairs(16, 512, 64, 0, eos=0, pad=1))
    return get_recipe("tiny_dpo", [*SMALL, f"data.preference_path={pairs}", "train.steps=6",
                                   "checkpoint.interval=3", "checkpoint.async_save=false", *extra])


def test_reference_cache_resumes_and_refuses_other_inputs(tmp_path):
    from olmax.model.params import init_params
    from olmax.sharding import make_mesh
    cfg = _cfg(tmp_path)
    mesh = make_mesh(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0))
    ps = PairSet(cfg.data.preference_path, cfg.data.sequence_length, cfg.data.pad_token_id)
    full = ReferenceCache(tmp_path / "a", ps, cfg)
    full.compute(params, cfg, mesh, chunk=4, say=lambda m: None)
    part = ReferenceCache(tmp_path / "b", ps, cfg)
    part.compute(params, cfg, mesh, chunk=4, say=lambda m: None, stop_after=2)  # interrupted after 8 pairs
    again = ReferenceCache(tmp_path / "b", ps, cfg)
    assert again.done == 8 and not again.complete
    again.compute(params, cfg, mesh, chunk=4, say=lambda m: None)
    np.testing.assert_array_equal(again.logps, full.logps)
    np.testing.assert_array_equal(again.counts, full.counts)
    assert (full.counts > 0).all() and (full.logps < 0).all()
    # Another reference (or other data) against the same cache: an error naming the file.
    other = get_recipe("tiny_dpo", [*SMALL, f"data.preference_path={cfg.data.preference_path}",
                                    "dpo.reference=hf:/nonexistent"])
    with pytest.raises(ConfigError, match=r"reference_logps/meta.json.*dpo.reference"):
        ReferenceCache(tmp_path / "a", ps, other)
    ps2 = PairSet(write_pairs(tmp_path / "pairs2", make_pairs(16, 512, 64, 1, eos=0, pad=1)), 64, 1)
    with pytest.raises(ConfigError, match=r"reference_logps/meta.json.*the preference data"):
        ReferenceCache(tmp_path / "a", ps2, cfg)


@pytest.mark.integration
def test_reference_run_directory_is_named_by_its_newest_checkpoint(tmp_path):
    """A reference that is a run directory is identified by its newest checkpoint's files: opening
    the run again (its lock, metrics, TensorBoard events) keeps the cache valid; a newer
    checkpoint does not."""
    from olmax.objectives.dpo import reference_identity
    from olmax.train.loop import train
    cfg = _cfg(tmp_path, "train.steps=3")
    run = tmp_path / "ref_run"
    train(cfg, run, progress=False)
    ref = _cfg(tmp_path, f"dpo.reference=olmax:{run}")
    before = reference_identity(ref)
    assert before["files"] and all(f.startswith("checkpoints/3/") for f in before["files"]), before["files"]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{}\n")
    (run / "tensorboard" / "events.out.tfevents.new").write_bytes(b"x" * 99)
    (run / ".olmax-train.lock").write_text('{"pid": 123456789}')
    assert reference_identity(ref) == before
    train(_cfg(tmp_path, "train.steps=6"), run, progress=False)  # resumed: a newer checkpoint
    after = reference_identity(ref)
    assert after != before and all(f.startswith("checkpoints/6/") for f in after["files"])


def test_bad_paths_are_errors_naming_them(tmp_path):
    from olmax.train.loop import train
    cfg = get_recipe("tiny_dpo", [*SMALL, f"data.preference_path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="nope"):
        train(cfg, tmp_path / "run", progress=False)
    cfg = get_recipe("tiny_dpo", SMALL)
    with pytest.raises(ConfigError, match="data.preference_path"):
        train(cfg, tmp_path / "run2", progress=False)
    cfg = _cfg(tmp_path, f"dpo.reference=hf:{tmp_path / 'no_ref'}")
    with pytest.raises(ConfigError, match="no_ref"):
        train(cfg, tmp_path / "run3", progress=False)
    # Pairs from a tokenizer larger than the model: refused before any step, naming the file and
    # pair (an id past the embedding reads as NaN, and every update would be skipped).
    pairs = make_pairs(16, 256, 64, 0, eos=0, pad=1)
    c, cm, r, rm = pairs[5]
    pairs[5] = (c, cm, r[:3] + [300] + r[4:], rm)        # one id past the vocabulary, in pair 5's rejected
    cfg = get_recipe("tiny_dpo", [*SMALL, "model.vocab_size=256", "model.padded_vocab_size=256",
                                  f"data.preference_path={write_pairs(tmp_path / 'big_ids', pairs)}"])
    with pytest.raises(ConfigError, match=r"big_ids/pairs_token_ids\.npy: token id 300 \(pair 5\) is outside the "
                                          r"model's vocabulary of 256 \(model.vocab_size\)"):
        train(cfg, tmp_path / "run4", progress=False)
    assert not (tmp_path / "run4" / "checkpoints").exists() or not any((tmp_path / "run4" / "checkpoints").iterdir())


@pytest.mark.integration
def test_tiny_dpo_run_resumes_bit_for_bit(tmp_path):
    """6 steps in one process vs 3, a new process, 3 more: the same metrics and weights, bit for
    bit; the reference log-probs are computed once."""
    cfg = _cfg(tmp_path)
    cli = [sys.executable, "-m", "olmax.cli", "train", "tiny_dpo", "--no-progress"]
    sets = [a for o in [*SMALL, f"data.preference_path={cfg.data.preference_path}", "train.steps=6",
                        "checkpoint.interval=3", "checkpoint.async_save=false"] for a in ("--set", o)]

    def run(d: Path, *extra: str) -> subprocess.CompletedProcess:
        r = subprocess.run(cli + ["--run-dir", str(d), *sets, *extra], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    run(tmp_path / "straight")
    first = run(tmp_path / "resumed", "--max-steps-this-run", "3")
    assert "reference log-probs done" in first.stderr
    second = run(tmp_path / "resumed")
    assert "resuming from checkpoint 3" in second.stderr and "reference log-probs" not in second.stderr

    def rows(d: Path) -> dict[int, dict]:
        out = {}
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("throughput/")}
        return out

    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert sorted(a) == list(range(1, 7)) and a == b
    assert a[1]["dpo/loss"] == pytest.approx(np.log(2), abs=1e-5)  # reference = the initial policy
    assert a[6]["dpo/loss"] < a[1]["dpo/loss"]
    # the closing line names the objective's loss (not a cross-entropy) and gives the last step's
    assert f"trained steps 3..6 in {tmp_path / 'resumed'}; last DPO loss {a[6]['dpo/loss']:.4f}" in second.stderr
    from olmax.checkpoint.load import load_params
    pa, _ = load_params(str(tmp_path / "straight"))
    pb, _ = load_params(str(tmp_path / "resumed"))
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_trl_parity_short(tmp_path):
    """``olmax verify trl --dpo`` for 3 steps (the 20-step figure: the slow test below and the README)."""
    from olmax.verify.trl import run
    rep = run(steps=3, seed=0, out=str(tmp_path / "v"))
    assert rep["ok"], {k: v for k, v in rep.items() if k != "rows"}
    assert rep["steps"] == 3 and rep["max_abs_loss_diff"] <= 1e-5 and rep["max_rel_grad_norm_diff"] <= 1e-5
    # A control: the reference differs from the policy, so step 1's loss is not log 2.
    assert abs(rep["rows"][0]["trl_loss"] - np.log(2)) > 1e-3


@pytest.mark.slow
def test_trl_parity_20_steps_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "verify", "trl", "--dpo", "--steps", "20", "--out",
                        str(tmp_path / "v"), "--json"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["steps"] == 20 and rep["ok"]
    assert set(rep) >= {"steps", "max_abs_loss_diff", "max_rel_grad_norm_diff", "rows"}


def test_hf_linear_schedule_is_transformers_linear_schedule():
    """optim.schedule.hf_linear (the DPO recipes' schedule, open-instruct's and TRL's) equals
    transformers' get_linear_schedule_with_warmup stepped once per update."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    from olmax.optim import make_schedule
    cfg = get_recipe("tiny_dpo", ["optim.lr=8e-8", "optim.schedule.warmup=11", "train.steps=117"])
    sched = make_schedule(cfg.optim, cfg.train.steps)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=8e-8)
    hf = get_linear_schedule_with_warmup(opt, 11, 117)
    for step in range(1, 118):  # olmax's 1-based global step = HF's update index + 1
        assert float(sched(step)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6, abs=1e-20), step
        opt.step()
        hf.step()
    assert float(sched(1)) == 0.0
