"""Optimiser parity with OLMo-core itself (``ai2-olmo-core``, PyTorch, CPU).

Schedules: our fp32 values against OLMo-core's scheduler classes evaluated in float64 (Python
floats), relative tolerance 1e-6. AdamW + clipping + skip-step: OLMo-core's ``SkipStepAdamW`` driven
through ``TransformerTrainModule.optim_step`` (its own clip / lr / step code) on the same loss and
gradient sequence; parameters compared after every step, skip decisions compared exactly.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import olmo_core.optim.scheduler as olmo_sched  # noqa: E402
import pytest

# The reference must run: a missing install fails here instead of skipping.
import torch  # noqa: E402
from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig  # noqa: E402
from olmo_core.train.common import Duration  # noqa: E402
from olmo_core.train.train_module.transformer.train_module import TransformerTrainModule  # noqa: E402
from olmo_core.train.trainer import Trainer  # noqa: E402

from olmax.config import Config, ConfigError, OptimConfig, ScheduleConfig, SkipStepConfig, validate  # noqa: E402
from olmax.optim import OptState, apply_update, init_opt_state, make_schedule, two_part_cosine  # noqa: E402
from olmax.recipes import olmo3_7b_stage1, olmo3_7b_stage2  # noqa: E402

SCHED_RTOL = 1e-6   # fp32 on our side vs float64 in OLMo-core
# Parameters, as max |ours - torch| / max |torch| per tensor, fp32 on both sides:
STEP_RTOL = 1e-6    # one update from OLMo-core's own state (observed <= 2.4e-7, i.e. 1-2 ulp)
# Over a whole trajectory each side random-walks on its own last-bit rounding, so no fixed
# constant is principled there: both fp32 runs are compared with OLMo-core in float64, and ours
# may be at most NOISE_FACTOR times as far from it as OLMo-core's own fp32 run is.
NOISE_FACTOR = 2.0


# --------------------------------------------------------------------------- helpers

# As the training loop uses it: the config and the run length static.
_update = jax.jit(apply_update, static_argnums=(4, 5))


def _trainer_max_steps(max_tokens: int, tokens_per_batch: int) -> int:
    """``trainer.max_steps`` for ``max_duration=Duration.tokens(max_tokens)``, from OLMo-core's code."""
    fake = SimpleNamespace(global_step=0, global_train_tokens_seen=0, tokens_per_batch=tokens_per_batch)
    return Trainer._get_max_steps(fake, Duration.tokens(max_tokens))


def _olmo_core_lr(scheduler, lr: float, step: int, max_steps: int) -> float:
    """The lr OLMo-core's train module sets for ``trainer.global_step == step``."""
    group = {"lr": lr}
    return float(scheduler.set_lr(group, SimpleNamespace(global_step=step, max_steps=max_steps)))


def _ours(optim_cfg: OptimConfig, total_steps: int, steps) -> np.ndarray:
    sched = jax.jit(make_schedule(optim_cfg, total_steps))
    return np.asarray(sched(jnp.asarray(steps, jnp.int32)), np.float64)


def _assert_rel(ours: np.ndarray, ref: np.ndarray, steps, rtol: float = SCHED_RTOL) -> None:
    ref = np.asarray(ref, np.float64)
    err = np.abs(ours - ref) / np.maximum(np.abs(ref), 1e-30)
    err[(ref == 0) & (ours == 0)] = 0.0
    worst = int(np.argmax(err))
    assert err[worst] <= rtol, f"step {steps[worst]}: ours {ours[worst]!r} vs OLMo-core {ref[worst]!r}"


# --------------------------------------------------------------------------- schedules


def test_stage1_two_part_schedule_matches_olmo_core():
    cfg = olmo3_7b_stage1()
    o, s = cfg.optim, cfg.optim.schedule
    tokens_per_batch = cfg.train.global_batch_size * cfg.data.sequence_length
    # The recipe's numbers are the scripts' numbers (pretrain-1: max_duration 5e12 tokens;
    # pretrain-2: 7e12 tokens, warmup_steps = int(5e12) // batch // 2 + 2000 // 2).
    t_max_1 = _trainer_max_steps(int(5e12), tokens_per_batch)
    t_max_2 = _trainer_max_steps(int(7e12), tokens_per_batch)
    assert (s.t_max, s.t_max_2, s.warmup) == (t_max_1, t_max_2, 2000)
    assert s.switch_step == int(5e12) // tokens_per_batch // 2 + 2000 // 2 == 597046

    part1 = olmo_sched.CosWithWarmup(warmup=s.warmup, alpha_f=s.alpha_f)
    part2 = olmo_sched.HalfCosWithWarmup(warmup=s.switch_step, alpha_f=s.alpha_f)
    sw = s.switch_step
    special = [1, 2, 3, 999, 1000, 1999, 2000, 2001, 2002, 100_000, 596_046, 596_047, 596_048,
               sw - 2, sw - 1, sw, sw + 1, sw + 2, 1_000_000, t_max_1 - 1, t_max_1, t_max_1 + 1,
               cfg.train.steps - 1, cfg.train.steps, t_max_2 - 1, t_max_2, t_max_2 + 1]
    rng = np.random.default_rng(0)
    steps = np.unique(np.concatenate([special, rng.integers(1, t_max_2 + 10, 2000)]))
    ref = [_olmo_core_lr(part1, o.lr, int(t), t_max_1) if t <= sw else _olmo_core_lr(part2, o.lr, int(t), t_max_2)
           for t in steps]
    ours = _ours(o, cfg.train.steps, steps)
    _assert_rel(ours, ref, steps)
    # Anchors from the spec: lr/2000 at the first update, (lr + eta_min) / 2 where part 2 begins,
    # about 3.93e-5 at the end of stage 1.
    at = dict(zip(steps.tolist(), ours.tolist()))
    assert at[1] == pytest.approx(o.lr / 2000, rel=1e-7)
    assert at[sw + 1] == pytest.approx((o.lr + o.lr * s.alpha_f) / 2, rel=1e-5)
    assert at[cfg.train.steps] == pytest.approx(3.93e-5, rel=3e-3)


def test_two_part_cosine_as_resumed_from_step596047():
    # OLMo-3-1025-7B-pretrain-2.py loads checkpoint step596047 while its HalfCosWithWarmup
    # "warmup" is 597046: steps 596048..597045 ran on the half-cosine's linear ramp.
    s = olmo3_7b_stage1().optim.schedule
    part1 = olmo_sched.CosWithWarmup(warmup=s.warmup, alpha_f=s.alpha_f)
    part2 = olmo_sched.HalfCosWithWarmup(warmup=597046, alpha_f=s.alpha_f)
    steps = np.array([1, 2000, 596_046, 596_047, 596_048, 596_500, 597_045, 597_046, 597_047, 1_413_814])
    ref = [_olmo_core_lr(part1, 3e-4, int(t), s.t_max) if t <= 596_047 else
           _olmo_core_lr(part2, 3e-4, int(t), s.t_max_2) for t in steps]
    ours = np.asarray(jax.jit(partial(two_part_cosine, lr=3e-4, warmup=s.warmup, t_max=s.t_max, alpha_f=s.alpha_f,
                                      switch_step=596_047, part2_warmup=597_046, t_max_2=s.t_max_2))(
        jnp.asarray(steps, jnp.int32)), np.float64)
    _assert_rel(ours, ref, steps)
    assert ours[4] < 0.999 * ours[3]                        # the ~0.2% drop at the resume


def test_stage2_linear_schedule_matches_olmo_core_at_every_step():
    cfg = olmo3_7b_stage2()
    o = cfg.optim
    # Midtrain script: max_duration = 100B tokens at 2**21 tokens per batch, LinearWithWarmup(0, 0.0).
    t_max = _trainer_max_steps(100_000_000_000, cfg.train.global_batch_size * cfg.data.sequence_length)
    assert t_max == o.schedule.t_max == cfg.train.steps == 47684
    ref_sched = olmo_sched.LinearWithWarmup(warmup=0, alpha_f=0.0)
    steps = np.arange(1, t_max + 2)
    ref = [_olmo_core_lr(ref_sched, o.lr, int(t), t_max) for t in steps]
    _assert_rel(_ours(o, cfg.train.steps, steps), ref, steps)


@pytest.mark.parametrize("name", ["cosine", "half_cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 7])
@pytest.mark.parametrize("alpha_f", [0.0, 0.1])
@pytest.mark.parametrize("t_max", [None, 50])
def test_schedules_match_olmo_core(name, warmup, alpha_f, t_max):
    total = 60                                  # t_max None means the run length (trainer.max_steps)
    cfg = OptimConfig(lr=1e-3, schedule=ScheduleConfig(name=name, warmup=warmup, t_max=t_max, alpha_f=alpha_f))
    cls = {"cosine": olmo_sched.CosWithWarmup, "half_cosine": olmo_sched.HalfCosWithWarmup,
           "linear": olmo_sched.LinearWithWarmup}
    if name == "constant":
        ref_sched = olmo_sched.ConstantWithWarmup(warmup=warmup) if warmup else olmo_sched.ConstantScheduler()
    else:
        ref_sched = cls[name](warmup=warmup, alpha_f=alpha_f, t_max=t_max)
    steps = np.arange(1, total + 5)
    ref = [_olmo_core_lr(ref_sched, cfg.lr, int(t), total) for t in steps]
    _assert_rel(_ours(cfg, total, steps), ref, steps)


def test_single_cosine_option_over_the_whole_run():
    # The MaxText simplification: one CosWithWarmup over the run length.
    steps_total = 1_414_078
    cfg = OptimConfig(lr=3e-4, schedule=ScheduleConfig(name="cosine", warmup=2000, t_max=None, alpha_f=0.1))
    ref_sched = olmo_sched.CosWithWarmup(warmup=2000, alpha_f=0.1)
    steps = np.array([1, 1999, 2000, 2001, 597_046, 1_000_000, 1_200_000, steps_total - 1, steps_total])
    ref = [_olmo_core_lr(ref_sched, 3e-4, int(t), steps_total) for t in steps]
    _assert_rel(_ours(cfg, steps_total, steps), ref, steps)


def test_schedule_accepts_traced_steps():
    cfg = olmo3_7b_stage1()
    sched = make_schedule(cfg.optim, cfg.train.steps)
    f = jax.jit(lambda done: sched(done + 1))        # the step is a traced int32, as in the loop
    assert float(f(jnp.int32(0))) == pytest.approx(3e-4 / 2000, rel=1e-7)
    assert float(f(jnp.int32(1999))) == pytest.approx(3e-4, rel=1e-7)


# --------------------------------------------------------------------------- AdamW + clip + skip-step


def _small_params(rng: np.random.Generator, dtype=np.float32) -> dict:
    V, D, H, K, E, F = 16, 8, 2, 1, 4, 12
    w = lambda *shape: (0.02 * rng.standard_normal(shape) + 0.05).astype(dtype)
    layer = lambda: {
        "attn": {"q": w(D, H * E), "k": w(D, K * E), "v": w(D, K * E), "o": w(H * E, D),
                 "q_norm": np.ones(H * E, dtype), "k_norm": np.ones(K * E, dtype)},
        "attn_norm": np.ones(D, dtype),
        "mlp": {"gate": w(D, F), "up": w(D, F), "down": w(F, D)},
        "mlp_norm": np.ones(D, dtype),
    }
    return {"embed": w(V, D), "layers": [layer(), layer()], "final_norm": np.ones(D, dtype), "lm_head": w(D, V)}


def _name(path) -> str:
    return "_".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


N_STEPS = 260
# Spikes stay in the 128-value history and widen the std for later ones, hence growing sizes.
# 20, 30 and 63 come before the history (current value included) holds 64 values: applied.
LOSS_SPIKES = {20: 6.0, 64: 7.0, 100: 9.0, 140: 11.0, 141: 13.0, 230: 16.0}   # step -> CE loss
NORM_SPIKES = {30: 10.0, 63: 10.0, 120: 30.0, 141: 40.0, 190: 60.0}           # step -> grad scale
NAN_LOSS_STEP = N_STEPS                                                      # last step: a NaN loss


def _sequence(rng: np.random.Generator, params: dict):
    """Per step: a CE loss (without z-loss) and a gradient tree, with planted spikes."""
    out = []
    for t in range(1, N_STEPS + 1):
        loss = 3.0 - 0.002 * t + 0.02 * rng.standard_normal()
        loss = LOSS_SPIKES.get(t, loss)
        if t == NAN_LOSS_STEP:
            loss = float("nan")
        # Total norm about 0.7-1.4, so clipping at 1.0 is active on about half the steps.
        scale = (0.02 + 0.02 * rng.random()) * NORM_SPIKES.get(t, 1.0)
        grads = jax.tree.map(lambda p: (scale * rng.standard_normal(p.shape)).astype(np.float32), params)
        out.append((np.float32(loss), grads))
    return out


def _olmo_core_run(params: dict, seq, cfg: OptimConfig, total_steps: int, dtype=np.float32):
    """OLMo-core's SkipStepAdamW driven exactly as TransformerTrainModule drives it (in ``dtype``:
    fp32 as trained, float64 as the reference for rounding noise)."""
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    module = torch.nn.Module()
    module.embeddings = torch.nn.Embedding(*params["embed"].shape, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
    with torch.no_grad():
        module.embeddings.weight.copy_(torch.from_numpy(np.array(params["embed"], dtype)))
    tensors = {}
    for path, x in named:
        n = _name(path)
        if n == "embed":
            tensors[n] = module.embeddings.weight
        else:
            module.register_parameter(n, torch.nn.Parameter(torch.from_numpy(np.array(x, dtype))))
            tensors[n] = getattr(module, n)
    sk = cfg.skip_step
    assert sk.min_history == max(2, sk.window // 2)           # OLMo-core derives it from the window
    optim = SkipStepAdamWConfig(
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        rolling_interval_length=sk.window, sigma_factor=sk.sigma_factor,
        # As in OLMo-3-1025-7B-pretrain-*.py: the embedding is not decayed.
        group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})],
    ).build(module)
    sc = cfg.schedule
    scheduler = olmo_sched.CosWithWarmup(warmup=sc.warmup, alpha_f=sc.alpha_f)
    recorded: dict = {}
    trainer = SimpleNamespace(global_step=0, max_steps=total_steps,
                              record_metric=lambda name, value, **_: recorded.__setitem__(name, value))
    tm = SimpleNamespace(optim=optim, scheduler=scheduler, max_grad_norm=cfg.max_grad_norm, trainer=trainer,
                         model=SimpleNamespace(parameters=module.parameters, post_optim_step=lambda: None),
                         record_metric=lambda name, value, **_: recorded.__setitem__(name, value))
    tm._clip_grad_norm = partial(TransformerTrainModule._clip_grad_norm, tm)

    history = []
    for t, (loss, grads) in enumerate(seq, start=1):
        trainer.global_step = t                                     # Trainer._fit_epoch: += 1 first
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            tensors[_name(path)].grad = torch.from_numpy(np.array(g, dtype))
        optim.latest_loss = torch.tensor(np.asarray(loss, dtype))    # train_batch: CE loss only
        TransformerTrainModule.optim_step(tm)                        # clip, set lr, step
        optim.zero_grad(set_to_none=True)
        history.append({
            "params": {n: p.detach().numpy().copy() for n, p in tensors.items()},
            "mu": {n: optim.state[p]["exp_avg"].numpy().copy() for n, p in tensors.items()},
            "nu": {n: optim.state[p]["exp_avg_sq"].numpy().copy() for n, p in tensors.items()},
            "adam_step": int(optim.state[tensors["embed"]]["step"]),
            "skipped": float(recorded["step skipped"]),
            "grad_norm": float(recorded["total grad norm"]),
            "lr": [float(g["lr"]) for g in optim.param_groups],
        })
    state = {n: optim.state[p] for n, p in tensors.items()}
    return history, state


def test_adamw_clip_skip_step_match_olmo_core():
    rng = np.random.default_rng(1234)
    params = _small_params(rng)
    seq = _sequence(rng, params)
    cfg = OptimConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decay_embeddings=False,
                      max_grad_norm=1.0, skip_step=SkipStepConfig(enabled=True, sigma_factor=6.0, window=128,
                                                                  min_history=64),
                      schedule=ScheduleConfig(name="cosine", warmup=20, t_max=None, alpha_f=0.1))
    ref, ref_state = _olmo_core_run(params, seq, cfg, N_STEPS)
    ref64, _ = _olmo_core_run(params, seq, cfg, N_STEPS, dtype=np.float64)

    update = _update
    p = jax.tree.map(jnp.asarray, params)
    state = init_opt_state(p, cfg)
    treedef = jax.tree.structure(params)
    names = [_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    as_tree = lambda d: jax.tree.unflatten(treedef, [jnp.asarray(d[n]) for n in names])

    def rel_err(tree, want: dict) -> float:
        return max(float(np.max(np.abs(np.asarray(x) - want[n])) / np.max(np.abs(want[n])))
                   for n, x in zip(names, jax.tree.leaves(tree)))

    worst_step = 0.0
    ours_drift = {"params": 0.0, "moments": 0.0}      # max relative distance from float64 OLMo-core
    ref_drift = {"params": 0.0, "moments": 0.0}
    clipped = 0
    ours_skipped = []
    prev = {"params": jax.tree.leaves(params), "mu": None, "nu": None, "adam_step": 0}
    for t, ((loss, grads), r) in enumerate(zip(seq, ref), start=1):
        # (a) One update from OLMo-core's previous params, moments and Adam step (and our history):
        # the update math itself, without accumulated rounding.
        if prev["mu"] is not None:
            s0 = state._replace(mu=as_tree(prev["mu"]), nu=as_tree(prev["nu"]),
                                adam_step=jnp.int32(prev["adam_step"]))
            p0 = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in prev["params"]])
            p1, _, _ = update(p0, grads, s0, jnp.float32(loss), cfg, N_STEPS)
            err = rel_err(p1, r["params"])
            worst_step = max(worst_step, err)
            assert err <= STEP_RTOL, f"step {t}: one-step relative parameter error {err:.2e}"
        # (b) Our own trajectory.
        p, state, m = update(p, grads, state, jnp.float32(loss), cfg, N_STEPS)
        ours_skipped.append(float(m["step_skipped"]))
        assert ours_skipped[-1] == r["skipped"], f"skip decision differs at step {t}"
        assert float(m["lr"]) == pytest.approx(r["lr"][0], rel=SCHED_RTOL)
        assert float(m["grad_norm"]) == pytest.approx(r["grad_norm"], rel=1e-6)
        assert int(state.adam_step) == r["adam_step"]
        clipped += float(m["clipped_grad_norm"]) < float(m["grad_norm"])
        r64 = ref64[t - 1]
        assert r64["skipped"] == r["skipped"], f"float64 reference skips differently at step {t}"
        ours_drift["params"] = max(ours_drift["params"], rel_err(p, r64["params"]))
        ours_drift["moments"] = max(ours_drift["moments"], rel_err(state.mu, r64["mu"]), rel_err(state.nu, r64["nu"]))
        as_np = lambda d: [d[n] for n in names]
        ref_drift["params"] = max(ref_drift["params"], rel_err(as_np(r["params"]), r64["params"]))
        ref_drift["moments"] = max(ref_drift["moments"], rel_err(as_np(r["mu"]), r64["mu"]),
                                   rel_err(as_np(r["nu"]), r64["nu"]))
        prev = {"params": [r["params"][n] for n in names], "mu": r["mu"], "nu": r["nu"],
                "adam_step": r["adam_step"]}
    print(f"relative error: params one step <= {worst_step:.2e}; distance from float64 OLMo-core over "
          f"{N_STEPS} steps: ours {ours_drift}, OLMo-core fp32 {ref_drift}")
    for k in ("params", "moments"):
        assert ref_drift[k] > 0, "the fp32 reference equals the float64 one: the noise floor is not measured"
        assert ours_drift[k] <= NOISE_FACTOR * ref_drift[k], (k, ours_drift[k], ref_drift[k])

    skipped = {t for t, s in enumerate(ours_skipped, start=1) if s}
    planted = set(LOSS_SPIKES) | set(NORM_SPIKES) | {NAN_LOSS_STEP}
    # The sequence exercises what it should: spikes before the history holds 64 values are
    # applied (63 is the last such step), every later spike is skipped (a NaN loss too), and
    # nothing else is.
    assert skipped == planted - {20, 30, 63}, sorted(skipped)
    assert 0.2 * N_STEPS < clipped < 0.8 * N_STEPS

    # Moments and Adam's step counter: OLMo-core counts applied updates only.
    assert int(state.adam_step) == N_STEPS - len(skipped) == int(ref_state["lm_head"]["step"])
    assert int(state.step) == N_STEPS


def test_skip_leaves_params_moments_and_adam_step_and_advances_the_rest():
    cfg = OptimConfig(lr=1e-2, skip_step=SkipStepConfig(window=8, min_history=4),
                      schedule=ScheduleConfig(name="linear", warmup=0, alpha_f=0.0))
    rng = np.random.default_rng(0)
    params = jax.tree.map(jnp.asarray, _small_params(rng))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    state = init_opt_state(params, cfg)
    for loss in [2.0, 2.01, 1.99, 2.0, 2.02]:
        params, state, m = _update(params, grads, state, jnp.float32(loss), cfg, 100)
        assert float(m["step_skipped"]) == 0.0
    before = (params, state)
    params, state, m = _update(params, grads, state, jnp.float32(50.0), cfg, 100)
    assert float(m["step_skipped"]) == 1.0
    assert float(m["lr"]) == pytest.approx(1e-2 * (1 - 6 / 100), rel=1e-6)
    jax.tree.map(np.testing.assert_array_equal, (params, state.mu, state.nu, state.adam_step),
                 (before[0], before[1].mu, before[1].nu, before[1].adam_step))
    assert int(state.step) == 6 and int(state.history_count) == 6
    assert float(state.loss_history[-1]) == 50.0                      # the spike stays in the history


def test_no_clipping_means_loss_only_skip_test():
    # OLMo-core sets latest_grad_norm only when max_grad_norm is set: without clipping a
    # grad-norm spike is not a skip.
    cfg = OptimConfig(max_grad_norm=None, skip_step=SkipStepConfig(window=8, min_history=4))
    params = {"w": jnp.ones((4,))}
    state = init_opt_state(params, cfg)
    for scale in [1.0, 1.1, 0.9, 1.0, 1.05, 1000.0]:
        params, state, m = _update(params, {"w": jnp.full((4,), 0.01 * scale)}, state, jnp.float32(2.0), cfg, 100)
    assert float(m["step_skipped"]) == 0.0 and float(m["grad_norm"]) == pytest.approx(20.0, rel=1e-6)


# --------------------------------------------------------------------------- moment dtype


def test_bf16_moments_are_refused():
    params = {"embed": jnp.zeros((4, 2), jnp.bfloat16)}
    cfg = dataclasses.replace(OptimConfig(), moments_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"\+0\.93"):
        validate(Config(optim=cfg))  # the one place config rules are checked
    good = init_opt_state(params, OptimConfig())
    bad = good._replace(mu=jax.tree.map(lambda m: m.astype(jnp.bfloat16), good.mu))
    with pytest.raises(ValueError, match=r"\+0\.93"):
        apply_update(params, params, bad, jnp.float32(1.0), OptimConfig(), 10)


def test_bf16_params_keep_fp32_moments():
    cfg = OptimConfig(lr=1e-2, schedule=ScheduleConfig(name="constant", warmup=0))
    rng = np.random.default_rng(3)
    p16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), _small_params(rng))
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p16)                 # the same values
    grads = jax.tree.map(lambda x: jnp.asarray(0.01 * rng.standard_normal(x.shape), jnp.bfloat16), p32)
    state = init_opt_state(p16, cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state.mu, state.nu)))
    new16, state16, _ = _update(p16, grads, state, jnp.float32(2.0), cfg, 10)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new16))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state16.mu, state16.nu)))
    # An fp32 run from the same values and gradients: same moments, and the bf16 params are its
    # result rounded to bf16 (the update itself is computed in fp32).
    new32, state32, _ = _update(p32, grads, init_opt_state(p32, cfg), jnp.float32(2.0), cfg, 10)
    jax.tree.map(np.testing.assert_array_equal, (state16.mu, state16.nu), (state32.mu, state32.nu))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32),
                                                         np.asarray(b.astype(jnp.bfloat16), np.float32), rtol=2**-8),
                 new16, new32)


def test_opt_state_is_a_pytree_with_history():
    cfg = OptimConfig()
    state = init_opt_state({"embed": jnp.zeros((2, 2))}, cfg)
    assert isinstance(state, OptState)
    assert state.loss_history.shape == state.norm_history.shape == (cfg.skip_step.window,)
    assert state.history_count.dtype == jnp.int32 and state.step.dtype == jnp.int32
    assert len(jax.tree.leaves(state)) == 7
