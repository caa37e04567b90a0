"""RL with verifiable rewards, the core: rewards, group advantages, the clipped policy
loss and its aggregations (``microbatch_mean`` against a float64 numpy reference), the train
step, and parity with TRL 1.16's GRPOTrainer (a short run here; 20 steps in the slow test)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.objectives.grpo import jit_grpo_step, make_grpo_step
from olmax.recipes import get_recipe
from olmax.rl import grpo
from olmax.rl.rewards import RewardFn, extract_math_answer, get_reward
from olmax.rl.rollout import PromptDataError, read_prompts

# --------------------------------------------------------------------------- rewards


# --------------------------------------------------------------------------- prompts


def test_prompt_file_not_utf8_names_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xff{"prompt": "a cat", "ground_truth": "e"}\n')
    with pytest.raises(PromptDataError, match=rf"rl.prompts_path {re.escape(str(bad))}: not UTF-8"):
        read_prompts(str(bad), None, 16)


def test_math_answer_extraction():
    assert extract_math_answer(r"so x = \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert extract_math_answer(r"\boxed{\frac{a}{b^{2}}}") == r"\frac{a}{b^{2}}"
    assert extract_math_answer("Final Answer: The final answer is $7$. I hope it is correct.") == "7"
    assert extract_math_answer("first $x=2$ then $4$") == "4"
    assert extract_math_answer("no answer here") is None


def test_math_reward_equivalence_and_multiplier():
    r = get_reward("math", multiplier=10.0)
    assert r(r"the answer is \boxed{\frac{1}{2}}", "0.5") == 10.0
    assert r("Final Answer: The final answer is $3$. I hope it is correct.", "3") == 10.0
    assert r(r"\boxed{2x+2}", "2(x+1)") == 10.0
    assert r(r"\boxed{5}", "4") == 0.0
    assert r("I don't know", "4") == 0.0
    assert r.failures == 0 and r.timeouts == 0 and r.calls == 5


def test_exact_match_format_and_import_path():
    assert get_reward("exact_match")("  42 \n", "42") == 1.0
    assert get_reward("exact_match")("42.0", "42") == 0.0
    f = get_reward("format", multiplier=2.0)
    assert f("think... <answer> 3 </answer>", "") == 2.0
    assert f("<answer>  </answer>", "") == 0.0 and f("3", "") == 0.0
    eq = get_reward("operator:eq")        # any module:function(completion, gold)
    assert eq("a", "a") == 1.0 and eq("a", "b") == 0.0
    with pytest.raises(ValueError, match="not a built-in"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("olmax_no_such_module:f")


def test_verifier_failures_and_timeouts_score_zero(capsys):
    r = get_reward("math:sqrt")          # raises TypeError for (completion, gold)
    assert r("x", "y") == 0.0 and r("x", "y") == 0.0
    assert r.failures == 2
    assert capsys.readouterr().err.count("TypeError") == 1          # logged once, counted always
    nan = RewardFn("exact_match")
    nan.score = lambda c, g: float("nan")
    assert nan("a", "a") == 0.0 and nan.failures == 1
    slow = RewardFn("exact_match", timeout_s=0.05)
    slow.score = lambda c, g: (time.sleep(0.5), 1.0)[1]
    assert slow("a", "a") == 0.0 and slow.timeouts == 1
    assert slow.stats()["rewards/exact_match/timeouts"] == 1


# --------------------------------------------------------------------------- advantages


def test_group_advantages_modes():
    r = np.array([0, 10, 10, 0, 5, 5, 5, 5, 1, 2, 3, 10], np.float32)
    g = r.astype(np.float64).reshape(-1, 4)
    mean = g.mean(1, keepdims=True)
    np.testing.assert_allclose(grpo.group_advantages(r, 4, "centered"), (g - mean).ravel(), atol=1e-6)
    np.testing.assert_allclose(grpo.group_advantages(r, 4, "standard"),
                               ((g - mean) / (g.std(1, keepdims=True) + 1e-8)).ravel(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grpo.group_advantages(r, 4, "trl_group"),
                               ((g - mean) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).ravel(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grpo.group_advantages(r, 4, "trl_batch"),
                               ((g - mean) / (g.std(ddof=1) + 1e-4)).ravel(), rtol=1e-6, atol=1e-6)
    assert grpo.zero_std_groups(r, 4).tolist() == [False, True, False]
    assert grpo.filter_zero_std(r, 4).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="groups of 5"):
        grpo.group_advantages(r, 5)
    with pytest.raises(ValueError, match="advantage mode"):
        grpo.group_advantages(r, 4, "nope")


# --------------------------------------------------------------------------- the per-token loss


def test_per_token_terms_clip_tis_kl():
    logp = jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]]))
    old = jnp.log(jnp.array([[0.25, 0.5, 0.7, 0.5]]))        # ratios 2, 1, 0.714, 1
    gen = jnp.log(jnp.array([[0.05, 0.5, 0.7, 0.5]]))        # old/gen = 5 -> capped at 2
    ref = jnp.log(jnp.array([[0.5, 0.25, 0.5, 0.5]]))
    loss = grpo.GrpoLoss(eps_low=0.2, eps_high=0.272, tis_cap=2.0, beta=0.1)
    for a in (1.0, -1.0):
        t = grpo.per_token_terms(logp, old, jnp.array([a]), loss, gen, ref)
        ratio = np.array([2.0, 1.0, 0.5 / 0.7, 1.0])
        base = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.272))
        w = np.minimum(np.exp(np.log([0.25, 0.5, 0.7, 0.5]) - np.log([0.05, 0.5, 0.7, 0.5])), 2.0)
        d = np.log([0.5, 0.25, 0.5, 0.5]) - np.log(0.5)
        kl = np.exp(d) - d - 1
        np.testing.assert_allclose(np.asarray(t["loss"][0]), base * w + 0.1 * kl, rtol=1e-5, atol=1e-6)
        clipped = [1, 0, 0, 0] if a > 0 else [0, 0, 1, 0]
        assert np.asarray(t["clipped"][0]).tolist() == clipped
        np.testing.assert_allclose(np.asarray(t["kl"][0]), kl, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="gen_logps"):
        grpo.per_token_terms(logp, old, jnp.array([1.0]), loss, None, ref)
    with pytest.raises(ValueError, match="aggregation"):
        grpo.GrpoLoss(aggregation="mean")


# --------------------------------------------------------------------------- the step


_CACHE: dict = {}


def _tiny():
    if "cfg" not in _CACHE:
        _CACHE["cfg"] = _make_tiny()
    return _CACHE["cfg"]


def _logps_fn():
    """One jitted log-prob function for every test here (compiling is most of their time)."""
    if "logps" not in _CACHE:
        _CACHE["logps"] = grpo.make_logps_fn(_tiny())
    return _CACHE["logps"]


def _make_tiny():
    return get_recipe("tiny", ["model.vocab_size=128", "model.padded_vocab_size=128", "model.d_model=32",
                               "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=16",
                               "model.mlp_hidden=64", "model.param_dtype=float32", "model.compute_dtype=float32",
                               "model.attention_impl=reference", "optim.max_grad_norm=null",
                               "optim.skip_step.enabled=false", "optim.schedule.name=constant",
                               "optim.schedule.warmup=0", "optim.weight_decay=0.0", "optim.lr=1e-3"])


def _batch(n=8, L=20, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 128, (n, L)).astype(np.int32)
    mask = np.zeros((n, L), bool)
    for i in range(n):                      # prompts of 4 tokens, completions of very different lengths
        mask[i, 4:4 + int(rng.integers(1, L - 4 + 1))] = True
    rewards = rng.integers(0, 2, n).astype(np.float32) * 10
    return ids, mask, grpo.group_advantages(rewards, 4)


def _grads_out(params, grads, opt_state, loss):
    """An ``apply_update`` stand-in that hands the accumulated gradients back as a metric."""
    return params, opt_state, {"grads": grads}


@pytest.mark.integration
def test_microbatch_mean_against_float64_numpy():
    """AI2's aggregation: masked token mean per micro-batch (rows a::accum), / accum steps. The
    loss against a float64 numpy reference built from the same per-token log-probs; the
    accumulated gradient against one full-batch backward with float64-computed token weights."""
    from olmax.model.params import init_params
    cfg = _tiny()
    params = init_params(cfg.model, jax.random.key(0))
    ids, mask, adv = _batch()
    lp = np.asarray(_logps_fn()(params, ids, mask), np.float64)
    rng = np.random.default_rng(1)
    tm = np.asarray(grpo.token_mask(jnp.asarray(mask)), np.float64)
    old = (lp + rng.normal(0, 0.3, lp.shape) * tm).astype(np.float32)   # ratios on both sides of the clip
    accum = 4
    step = jax.jit(make_grpo_step(cfg, grpo.GrpoLoss(aggregation="microbatch_mean"), accum, _grads_out))
    batch = {"input_ids": ids, "completion_mask": mask, "advantages": adv, "old_logps": old}
    _, _, m = step(params, None, batch)

    ratio = np.exp(lp - old.astype(np.float64))
    a = adv.astype(np.float64)[:, None]
    per_tok = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.272))
    ref, weights = 0.0, np.zeros_like(tm)
    for k in range(accum):
        rows = np.arange(k, len(ids), accum)
        cnt = tm[rows].sum()
        ref += (per_tok[rows] * tm[rows]).sum() / cnt / accum
        weights[rows] = tm[rows] / cnt / accum
    assert abs(float(m["loss"]) - ref) < 1e-6, (float(m["loss"]), ref)
    clip_ref = (((ratio < 0.8) & (a < 0)) | ((ratio > 1.272) & (a > 0))) * tm
    assert float(m["clip_fraction"]) == pytest.approx(clip_ref.sum() / tm.sum(), abs=1e-6)
    assert 0 < float(m["clip_fraction"]) < 1
    # It is not the global token mean (the micro-batches hold different token counts).
    assert abs(ref - (per_tok * tm).sum() / tm.sum()) > 1e-4

    w = jnp.asarray(weights, jnp.float32)

    def direct(p):
        lpp = grpo.policy_logps(p, jnp.asarray(ids), jnp.asarray(mask), cfg)
        t = grpo.per_token_terms(lpp, jnp.asarray(old), jnp.asarray(adv), grpo.GrpoLoss())
        return jnp.sum(t["loss"] * w)

    g_direct = jax.grad(direct)(params)
    for x, y in zip(jax.tree.leaves(m["grads"]), jax.tree.leaves(g_direct)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)


@pytest.mark.integration
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_token_and_sequence_mean_do_not_depend_on_accumulation(aggregation):
    from olmax.model.params import init_params
    cfg = _tiny()
    params = init_params(cfg.model, jax.random.key(0))
    ids, mask, adv = _batch(seed=3)
    old = np.asarray(_logps_fn()(params, ids, mask)) - 0.2 * np.asarray(grpo.token_mask(mask))
    batch = {"input_ids": ids, "completion_mask": mask, "advantages": adv, "old_logps": old}
    out = {}
    for accum in (1, 4):
        step = jax.jit(make_grpo_step(cfg, grpo.GrpoLoss(aggregation=aggregation), accum, _grads_out))
        _, _, m = step(params, None, batch)
        out[accum] = (float(m["loss"]), m["grads"])
    lp = np.asarray(_logps_fn()(params, ids, mask), np.float64)
    tm = np.asarray(grpo.token_mask(mask), np.float64)
    ratio = np.exp(lp - old)
    a = adv.astype(np.float64)[:, None]
    pt = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.272)) * tm
    ref = pt.sum() / tm.sum() if aggregation == "token_mean" else np.mean(pt.sum(1) / tm.sum(1))
    assert out[1][0] == pytest.approx(ref, abs=1e-6) and out[4][0] == pytest.approx(ref, abs=1e-6)
    for x, y in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[4][1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)


def test_train_on_batch_several_optimizer_steps():
    """Two epochs x two mini-batches = four AdamW updates on one rollout batch: the first sees
    ratio 1 (no clipping), later ones move off 1; the loss and metrics are finite."""
    from olmax.model.params import init_params
    from olmax.optim import init_opt_state
    cfg = _tiny()
    params = init_params(cfg.model, jax.random.key(0))
    ids, mask, adv = _batch(n=16, seed=5)
    batch = {"input_ids": jnp.asarray(ids), "completion_mask": jnp.asarray(mask), "advantages": jnp.asarray(adv)}
    batch["old_logps"] = _logps_fn()(params, batch["input_ids"], batch["completion_mask"])
    step = jit_grpo_step(cfg, grpo.GrpoLoss(), accum_steps=2, total_steps=4)
    opt = init_opt_state(params, cfg.optim)
    _, _, rows = grpo.train_on_batch(params, opt, batch, step, num_mini_batches=2, num_epochs=2)
    assert len(rows) == 4
    assert rows[0]["clip_fraction"] == 0.0 and abs(rows[0]["ratio_mean"] - 1) < 1e-5
    assert abs(rows[2]["ratio_mean"] - 1) > 1e-5          # epoch 2 sees the updated policy
    for r in rows:
        assert {"loss", "clip_fraction", "kl", "grad_norm", "lr"} <= set(r) and np.isfinite(r["loss"])
    with pytest.raises(ValueError, match="mini-batches"):
        grpo.train_on_batch(params, opt, batch, step, num_mini_batches=3)


# --------------------------------------------------------------------------- TRL parity


def test_trl_grpo_parity_short(tmp_path):
    """``olmax verify trl --grpo`` on one generation batch, loss_type dapo: two optimizer steps,
    the second with ratios != 1 (clipping acts); the slow test runs 20 steps of dapo and grpo."""
    from olmax.verify.trl_grpo import run
    rep = run(steps=2, seed=0, out=str(tmp_path / "v"), loss_types=("dapo",))
    assert rep["ok"], {k: v for k, v in rep.items() if k != "rows"}
    assert rep["steps"] == 2 and rep["max_abs_loss_diff"] <= 1e-5 and rep["max_rel_grad_norm_diff"] <= 1e-5
    assert rep["rows"][0]["olmax_clip_fraction"] == 0 and rep["rows"][1]["olmax_clip_fraction"] > 0


def test_verify_trl_needs_one_check():
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "verify", "trl", "--dpo", "--grpo", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "exactly one of --dpo or --grpo" in r.stdout


@pytest.mark.slow
def test_trl_grpo_parity_20_steps_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "verify", "trl", "--grpo", "--steps", "20", "--out",
                        str(tmp_path / "v"), "--json"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["steps"] == 40 and rep["loss_types"] == ["dapo", "grpo"]
    assert set(rep) >= {"steps", "max_abs_loss_diff", "max_rel_grad_norm_diff", "rows"}
