"""``olmax verify trl --grpo``: per-step GRPO training parity with HF TRL 1.16's ``GRPOTrainer``.

Both sides train the same tiny OLMo 3 (fp32, CPU) on the same fixed prompts, completions and
rewards, so only the loss, its aggregation, the gradients and the optimizer are compared:

1. olmax initialises the model (seed S) and writes it as a HF directory with its converter
   (``olmax.compat.hf.write_hf``); TRL loads ``Olmo3ForCausalLM`` from it (eager attention).
2. Fixed rollouts: per generation batch, ``PROMPTS`` prompts of ``PROMPT_LEN`` tokens, each with
   ``GROUP`` completions of 1..``MAX_COMPLETION`` random tokens (some ending in EOS) and rewards in
   {0, 10} (one group per batch has equal rewards, so its advantages are 0).
3. TRL's generation is replaced through its ``rollout_func`` hook (``GRPOTrainer(rollout_func=)``):
   it returns the fixed prompt and completion ids of each prompt (dataset rows name a prompt by its
   index) and each completion's reward as an extra field, which a reward function hands back. The
   rest of TRL's pipeline runs as is: advantages (``scale_rewards="none"``: reward minus the group
   mean), old log-probs from the model before the batch's first update, its shuffle and split into
   ``gradient_accumulation_steps`` micro-batches, the loss (``loss_type`` "dapo" and "grpo",
   ``epsilon=0.2``, ``epsilon_high=0.272``, ``beta=0``), ``num_iterations=2`` optimizer steps per
   generation batch (the second step sees ratios != 1, so the clip acts), torch AdamW with a
   constant lr, no clipping (``max_grad_norm=0``: the Trainer reports the norm unclipped).
4. olmax: ``olmax.rl.grpo`` with the matching aggregation (dapo -> ``token_mean``, grpo ->
   ``sequence_mean``), ``group_advantages(mode="centered")``, old log-probs from
   ``make_logps_fn``, ``train_on_batch(num_epochs=2)`` of ``olmax.objectives.grpo``'s step with
   the same accumulation steps, and ``olmax.optim.apply_update`` (AdamW, constant lr).
5. Per optimizer step: the loss and the grad norm of each side (TRL's logged ``loss`` and
   ``grad_norm``), and olmax's clip fraction (TRL's ``clip_ratio/region_mean`` beside it).

Target: |delta loss| <= 1e-5 and grad norm within 1e-5 relative at every step.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from olmax import jsonout
from olmax.config import Config, ConfigError
from olmax.extras import require
from olmax.verify.olmo_core import PARITY_MODEL

TOLERANCE = 1e-5
LOSS_TYPES = {"dapo": "token_mean", "grpo": "sequence_mean"}
PROMPTS, GROUP, PROMPT_LEN, MAX_COMPLETION = 4, 4, 8, 24
ACCUM = 2           # gradient accumulation steps (TRL micro-batches of PROMPTS * GROUP / ACCUM rows)
ITERATIONS = 2      # optimizer steps per generation batch (TRL num_iterations)
EOS, PAD = 0, 1

PARITY_OVERRIDES: tuple[str, ...] = (
    *PARITY_MODEL,
    f"data.eos_token_id={EOS}", f"data.pad_token_id={PAD}",
    "optim.lr=1e-4", "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8", "optim.weight_decay=0.0",
    "optim.max_grad_norm=null", "optim.skip_step.enabled=false",
    "optim.schedule.name=constant", "optim.schedule.warmup=0",
)


def parity_config(seed: int = 0, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    from olmax.recipes import get_recipe
    cfg = get_recipe("tiny", [*PARITY_OVERRIDES, f"train.seed={seed}", *overrides])
    o, bad = cfg.optim, []
    if not (o.schedule.name == "constant" and o.schedule.warmup == 0):
        bad.append("optim.schedule must be constant with no warmup")
    if o.max_grad_norm is not None or o.skip_step.enabled:
        bad.append("optim.max_grad_norm must be null and optim.skip_step.enabled false")
    if cfg.model.param_dtype != "float32" or cfg.model.compute_dtype != "float32":
        bad.append("the model must be fp32")
    if cfg.model.padded_vocab_size not in (None, cfg.model.vocab_size):
        bad.append("model.padded_vocab_size must equal model.vocab_size")
    if bad:
        raise ConfigError("verify trl --grpo: " + "; ".join(bad))
    return cfg


def make_rollouts(batches: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    """Fixed rollouts: per batch, ``prompts`` [P] token lists, ``completions`` [P][G] token lists,
    ``rewards`` float32 [P, G] in {0, 10}; the last group of each batch has equal rewards."""
    rng = np.random.default_rng(seed)
    low = max(EOS, PAD) + 1
    out = []
    for _ in range(batches):
        prompts = [rng.integers(low, vocab, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
        comps = []
        for _ in range(PROMPTS):
            row = []
            for _ in range(GROUP):
                n = int(rng.integers(1, MAX_COMPLETION + 1))
                c = rng.integers(low, vocab, n).tolist()
                if rng.random() < 0.5:
                    c[-1] = EOS
                row.append(c)
            comps.append(row)
        rewards = 10.0 * rng.integers(0, 2, (PROMPTS, GROUP)).astype(np.float32)
        rewards[:-1, 0], rewards[:-1, 1] = 0.0, 10.0      # informative groups
        rewards[-1] = rewards[-1, 0]                       # one zero-std group
        out.append({"prompts": prompts, "completions": comps, "rewards": rewards})
    return out


def rollout_arrays(ro: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids int32 [P*G, L], completion_mask bool [P*G, L], rewards float32 [P*G])``, rows
    grouped by prompt, completions right-padded to ``L = PROMPT_LEN + MAX_COMPLETION``."""
    L = PROMPT_LEN + MAX_COMPLETION
    n = PROMPTS * GROUP
    ids = np.full((n, L), PAD, np.int32)
    mask = np.zeros((n, L), bool)
    for p in range(PROMPTS):
        for g in range(GROUP):
            r, c = p * GROUP + g, ro["completions"][p][g]
            ids[r, :PROMPT_LEN] = ro["prompts"][p]
            ids[r, PROMPT_LEN:PROMPT_LEN + len(c)] = c
            mask[r, PROMPT_LEN:PROMPT_LEN + len(c)] = True
    return ids, mask, ro["rewards"].reshape(-1)


def _run_olmax(cfg: Config, params: Any, rollouts: list[dict[str, Any]], aggregation: str) -> list[dict[str, float]]:
    import jax.numpy as jnp

    from olmax.objectives.grpo import jit_grpo_step
    from olmax.optim import init_opt_state
    from olmax.rl.grpo import GrpoLoss, group_advantages, make_logps_fn, train_on_batch
    loss = GrpoLoss(eps_low=0.2, eps_high=0.272, aggregation=aggregation)
    total = len(rollouts) * ITERATIONS
    step = jit_grpo_step(cfg, loss, ACCUM, total)
    logps = make_logps_fn(cfg)
    opt = init_opt_state(params, cfg.optim)
    rows = []
    for ro in rollouts:
        ids, mask, rewards = rollout_arrays(ro)
        batch = {"input_ids": jnp.asarray(ids), "completion_mask": jnp.asarray(mask),
                 "advantages": jnp.asarray(group_advantages(rewards, GROUP, "centered"))}
        batch["old_logps"] = logps(params, batch["input_ids"], batch["completion_mask"])
        params, opt, ms = train_on_batch(params, opt, batch, step, num_epochs=ITERATIONS)
        rows += ms
    return rows


def _run_trl(cfg: Config, policy: Path, rollouts: list[dict[str, Any]], loss_type: str, out: Path
             ) -> list[dict[str, float]]:
    import datasets
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import Olmo3ForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    vocab = {str(i): i for i in range(m.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=str(PAD))),
                                  pad_token=str(PAD), eos_token=str(EOS))
    # Dataset row k names prompt k % PROMPTS of generation batch k // PROMPTS.
    ds = datasets.Dataset.from_list([{"prompt": str(k)} for k in range(len(rollouts) * PROMPTS)])

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list]:
        seen: dict[str, int] = {}
        p_ids, c_ids, lps, rew = [], [], [], []
        for key in prompts:
            j = seen.get(key, 0)
            seen[key] = j + 1
            b, p = divmod(int(key), PROMPTS)
            ro = rollouts[b]
            c = ro["completions"][p][j]
            p_ids.append(list(ro["prompts"][p]))
            c_ids.append(list(c))
            lps.append([0.0] * len(c))
            rew.append(float(ro["rewards"][p, j]))
        return {"prompt_ids": p_ids, "completion_ids": c_ids, "logprobs": lps, "fixed_reward": rew}

    def fixed_reward(prompts, completions, fixed_reward, **kw):
        return list(fixed_reward)

    o = cfg.optim
    n = PROMPTS * GROUP
    args = GRPOConfig(
        output_dir=str(out / f"trl_{loss_type}"), loss_type=loss_type, scale_rewards="none", beta=0.0,
        epsilon=0.2, epsilon_high=0.272, num_generations=GROUP, num_iterations=ITERATIONS,
        per_device_train_batch_size=n // ACCUM, gradient_accumulation_steps=ACCUM,
        max_completion_length=MAX_COMPLETION, temperature=1.0, shuffle_dataset=False,
        learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=o.beta1, adam_beta2=o.beta2,
        adam_epsilon=o.eps, weight_decay=o.weight_decay, optim="adamw_torch", max_grad_norm=0.0,
        max_steps=len(rollouts) * ITERATIONS, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        seed=cfg.train.seed, data_seed=cfg.train.seed, bf16=False, fp16=False, dataloader_num_workers=0,
        disable_tqdm=True, gradient_checkpointing=False, log_completions=False,
    )
    model = Olmo3ForCausalLM.from_pretrained(str(policy), torch_dtype=torch.float32, attn_implementation="eager")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = GRPOTrainer(model=model, reward_funcs=fixed_reward, args=args, train_dataset=ds, processing_class=tok,
                          rollout_func=rollout_func)
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return [{"step": int(h["step"]), "loss": float(h["loss"]), "grad_norm": float(h["grad_norm"]),
             "clip_ratio": float(h.get("clip_ratio/region_mean", math.nan))} for h in logs]


def run(steps: int = 4, seed: int = 0, overrides: list[str] | tuple[str, ...] = (), out: str | None = None,
        loss_types: tuple[str, ...] = ("dapo", "grpo")) -> dict[str, Any]:
    """Both trainings per loss type and the per-step comparison (the JSON report). ``steps`` is
    the number of optimizer steps (rounded up to a multiple of ``ITERATIONS``)."""
    require("verify", "torch", "transformers", "trl", "datasets")  # before olmax's side trains
    import jax

    from olmax.compat.hf import write_hf
    from olmax.model.params import init_params
    from olmax.model.weights_io import flatten_tree
    t0 = time.perf_counter()
    cfg = parity_config(seed, overrides)
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="olmax-verify-trl-grpo-"))
    root.mkdir(parents=True, exist_ok=True)
    batches = max(1, -(-steps // ITERATIONS))
    rollouts = make_rollouts(batches, cfg.model.vocab_size, seed)
    params = init_params(cfg.model, jax.random.key(seed))
    named = [(k, np.asarray(v, np.float32)) for k, v in flatten_tree(params)]
    if (root / "policy_hf").exists():   # a rerun into the same --out
        import shutil
        shutil.rmtree(root / "policy_hf")
    policy = write_hf(named, cfg, root / "policy_hf", "float32")
    rows, seconds = [], {}
    for lt in loss_types:
        t1 = time.perf_counter()
        ox = _run_olmax(cfg, jax.tree.map(lambda a: a.copy(), params), rollouts, LOSS_TYPES[lt])
        t2 = time.perf_counter()
        tr = _run_trl(cfg, policy, rollouts, lt, root)
        t3 = time.perf_counter()
        seconds[lt] = {"olmax": round(t2 - t1, 1), "trl": round(t3 - t2, 1)}
        for k, (o, t) in enumerate(zip(ox, tr)):
            row = {"loss_type": lt, "aggregation": LOSS_TYPES[lt], "step": k + 1, "trl_step": t["step"],
                   "olmax_loss": o["loss"], "trl_loss": t["loss"],
                   "olmax_grad_norm": o["grad_norm"], "trl_grad_norm": t["grad_norm"],
                   "olmax_clip_fraction": o["clip_fraction"], "trl_clip_ratio": t["clip_ratio"]}
            row["abs_loss_diff"] = abs(row["olmax_loss"] - row["trl_loss"])
            row["rel_grad_norm_diff"] = (abs(row["olmax_grad_norm"] - row["trl_grad_norm"])
                                         / max(abs(row["trl_grad_norm"]), 1e-30))
            rows.append(row)
        if len(ox) != len(tr):
            rows.append({"loss_type": lt, "error": f"olmax ran {len(ox)} steps, TRL logged {len(tr)}"})
    good = [r for r in rows if "error" not in r]

    def mx(key: str) -> float:
        return max((r[key] for r in good), default=math.nan)

    report = {
        "steps": len(good),
        "requested_steps": batches * ITERATIONS * len(loss_types),
        "loss_types": list(loss_types),
        "max_abs_loss_diff": mx("abs_loss_diff"),
        "max_rel_grad_norm_diff": mx("rel_grad_norm_diff"),
        "max_clip_fraction": mx("olmax_clip_fraction"),
        "tolerance": TOLERANCE,
        "seconds": {**seconds, "total": round(time.perf_counter() - t0, 1)},
        "out": str(root),
        "rows": rows,
    }
    report["ok"] = (len(good) == len(rows) == report["requested_steps"]
                    and all(r["abs_loss_diff"] <= TOLERANCE and r["rel_grad_norm_diff"] <= TOLERANCE for r in good)
                    and report["max_clip_fraction"] > 0)
    return report


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"{'loss':>5} {'step':>4} {'loss olmax':>13} {'loss trl':>13} {'|dloss|':>9} {'grad norm':>10} "
             f"{'rel dnorm':>9} {'clip frac':>9}"]
    for r in rep["rows"]:
        if "error" in r:
            lines.append(f"{r['loss_type']:>5} ERROR {r['error']}")
            continue
        lines.append(f"{r['loss_type']:>5} {r['step']:>4} {r['olmax_loss']:>13.9f} {r['trl_loss']:>13.9f} "
                     f"{r['abs_loss_diff']:>9.2e} {r['trl_grad_norm']:>10.5f} {r['rel_grad_norm_diff']:>9.2e} "
                     f"{r['olmax_clip_fraction']:>9.4f}")
    verdict = "PASS" if rep["ok"] else "FAIL"
    lines.append(f"{verdict}: {rep['steps']} steps; max |dloss| {rep['max_abs_loss_diff']:.2e}, max rel d grad norm "
                 f"{rep['max_rel_grad_norm_diff']:.2e} (tolerance {rep['tolerance']:g}); clip fraction up to "
                 f"{rep['max_clip_fraction']:.3f}; files in {rep['out']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """The ``--grpo`` handler of ``olmax verify trl``."""
    rep = run(args.steps, args.seed, args.overrides, args.out)
    print(jsonout.dumps(rep, indent=2) if args.json else format_report(rep))
    sys.stdout.flush()
    return 0 if rep["ok"] else 1


def attach(vs: argparse._SubParsersAction) -> None:
    """Add ``--grpo`` to the ``olmax verify trl`` parser that ``olmax.verify.trl.register`` made
    (its ``--dpo`` stops being required; exactly one of the two is). ``--steps``, ``--seed``,
    ``--set``, ``--out`` and ``--json`` are shared; with ``--grpo``, ``--steps`` counts the
    optimizer steps of each loss type (rounded up to a multiple of 2)."""
    p = vs.choices["trl"]
    for action in p._actions:
        if action.dest == "dpo":
            action.required = False
            action.help = "check DPO against TRL 1.16's DPOTrainer(loss_type='sigmoid_norm')"
    p.add_argument("--grpo", action="store_true",
                   help="check GRPO against TRL 1.16's GRPOTrainer (loss_type dapo and grpo) on fixed rollouts")
    dpo_main = p.get_default("func")

    def dispatch(args: argparse.Namespace) -> int:
        if args.dpo == args.grpo:
            raise ConfigError("olmax verify trl: pass exactly one of --dpo or --grpo")
        return main(args) if args.grpo else dpo_main(args)

    p.set_defaults(func=dispatch)
