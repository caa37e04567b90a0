"""``olmax verify trl --dpo``: per-step DPO training parity with HF TRL 1.16's ``DPOTrainer``.

One resolved olmax config drives both sides:

1. Two different tiny OLMo 3 models (olmax's initialisation from seeds S and S + 1) are written as
   HF directories by olmax's converter: the policy's initial weights and the reference model. The reference
   differs from the policy, so the reference log-probs are not the policy's own at step 0 and a wrong
   reference (or one taken from the policy) shows at once.
2. Generated preference pairs (a shared prompt, then a chosen or a rejected response ending in
   EOS; label mask True on the response) are written as an ``olmax-pairs/1`` folder.
3. olmax trains with its real loop (``olmax.train.loop.train``, ``train.objective=dpo``,
   ``train.init_from=hf:POLICY``, ``dpo.reference=hf:REF``): reference log-probs cached in a
   first pass, then the steps.
4. TRL trains ``Olmo3ForCausalLM`` (eager attention, fp32, CPU) from the same two directories
   with ``DPOTrainer(loss_type="sigmoid_norm")`` and a separate ``ref_model`` (reference log-probs
   computed in every step's forward, ``precompute_ref_log_probs=False``), the pairs already
   tokenized (``_prepare_dataset`` is bypassed: no chat template, no EOS added) and presented in
   olmax's order (``train_sampling_strategy="sequential"`` over the pairs of each olmax step);
   torch AdamW with the same lr, betas, eps and weight decay, HF's ``linear`` schedule with the same
   warmup (olmax: ``optim.schedule.hf_linear``), no clipping (``max_grad_norm=0``: the Trainer then
   reports the norm without clipping).
5. Per step: the loss, the pre-clip gradient norm, the lr and the rewards. TRL logs
   ``rewards/chosen`` and ``rewards/rejected`` as beta times the difference of *summed*
   log-probs, whatever the loss type; the rewards its ``sigmoid_norm`` loss is made of (beta times
   the log-ratio divided by the completion's token count, what olmax logs as ``dpo/rewards/*``, as
   open-instruct does) are rebuilt from the per-token log-probs of TRL's own forward passes
   (forward hooks). Both are reported; the length-normalised ones are judged (the summed ones are
   differences of two fp32 sums of tens of log-probs near -6, whose rounding alone is ~1e-5).

Target: |delta loss| <= 1e-5, |delta reward| <= 1e-5 and grad norm within 1e-5
relative at each of 20 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from olmax import jsonout
from olmax.argtypes import positive_int
from olmax.argtypes import seed as seed_flag
from olmax.config import Config, ConfigError
from olmax.extras import require
from olmax.verify.olmo_core import PARITY_MODEL

TOLERANCE = 1e-5   # loss and rewards absolute, grad norm relative

PARITY_OVERRIDES: tuple[str, ...] = (
    *PARITY_MODEL,
    "data.sequence_length=64", "data.eos_token_id=0", "data.pad_token_id=1",
    "train.global_batch_size=4", "train.log_interval=1",
    "optim.lr=1e-4", "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8", "optim.weight_decay=0.0",
    "optim.max_grad_norm=null", "optim.skip_step.enabled=false",
    "optim.schedule.name=hf_linear", "optim.schedule.warmup=2",
    "dpo.loss=dpo_norm", "dpo.beta=5.0", "dpo.label_smoothing=0.0",
)
PAIRS = 48          # 12 steps of 4 pairs per epoch: 20 steps cross an epoch boundary (new order)


def parity_config(steps: int = 20, seed: int = 0, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    from olmax.recipes import get_recipe
    cfg = get_recipe("tiny_dpo", [*PARITY_OVERRIDES, f"train.steps={steps}", f"data.seed={seed}",
                                  f"train.seed={seed}", *overrides])
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval=cfg.train.steps, async_save=False))
    bad = []
    o = cfg.optim
    if not (o.schedule.name == "hf_linear" or (o.schedule.name == "constant" and o.schedule.warmup == 0)):
        bad.append("optim.schedule must be hf_linear (HF's linear schedule) or constant with no warmup")
    if o.schedule.t_max not in (None, cfg.train.steps) or o.schedule.warmup_fraction is not None:
        bad.append("optim.schedule.t_max must be null (= train.steps) and optim.schedule.warmup a step count")
    if o.max_grad_norm is not None or o.skip_step.enabled:
        bad.append("optim.max_grad_norm must be null and optim.skip_step.enabled false")
    if cfg.dpo.loss != "dpo_norm" or cfg.dpo.label_smoothing != 0.0:
        bad.append("dpo.loss must be dpo_norm with dpo.label_smoothing 0 (TRL's sigmoid_norm has no smoothing)")
    if cfg.model.param_dtype != "float32" or cfg.model.compute_dtype != "float32":
        bad.append("the model must be fp32")
    if cfg.model.padded_vocab_size not in (None, cfg.model.vocab_size):
        bad.append("model.padded_vocab_size must equal model.vocab_size")
    if bad:
        raise ConfigError("verify trl --dpo: " + "; ".join(bad))
    return cfg


def make_pairs(n: int, vocab: int, max_len: int, seed: int, eos: int, pad: int) -> list[tuple]:
    """``n`` pairs (prompt + chosen + EOS, prompt + rejected + EOS) of at most ``max_len`` tokens,
    label mask True on the response and its EOS. Token ids avoid EOS and pad elsewhere."""
    rng = np.random.default_rng(seed)
    low = max(eos, pad) + 1
    out = []
    for _ in range(n):
        p = rng.integers(low, vocab, int(rng.integers(2, 24))).tolist()
        room = max_len - len(p) - 1
        c = rng.integers(low, vocab, int(rng.integers(1, room + 1))).tolist() + [eos]
        r = rng.integers(low, vocab, int(rng.integers(1, room + 1))).tolist() + [eos]
        out.append((p + c, [False] * len(p) + [True] * len(c), p + r, [False] * len(p) + [True] * len(r)))
    return out


def _hf_models(cfg: Config, root: Path, seed: int) -> tuple[Path, Path]:
    """The policy (olmax's initialisation from ``seed``) and the reference (from ``seed + 1``), both
    written as HF directories by olmax's converter (``olmax.compat.hf.write_hf``)."""
    import jax

    from olmax.compat.hf import write_hf
    from olmax.model.params import init_params
    from olmax.model.weights_io import flatten_tree
    out = []
    for name, s in (("policy_hf", seed), ("reference_hf", seed + 1)):
        params = init_params(cfg.model, jax.random.key(s))
        named = [(k, np.asarray(v, np.float32)) for k, v in flatten_tree(params)]
        out.append(write_hf(named, cfg, root / name, "float32"))
    return out[0], out[1]


def _run_olmax(cfg: Config, run_dir: Path) -> dict[int, dict[str, float]]:
    from olmax.train.loop import train
    train(cfg, run_dir, progress=False)
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "dpo/loss" in r:
            rows[int(r["step"])] = r
    return rows


def _run_trl(cfg: Config, policy: Path, reference: Path, pairs: list[tuple], order: list[int], out: Path
             ) -> list[dict[str, float]]:
    import datasets
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import Olmo3ForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(cfg.train.seed)
    m, d = cfg.model, cfg.data
    # A word-level tokenizer over the ids: only its pad/eos ids matter (the data is pre-tokenized).
    vocab = {str(i): i for i in range(m.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=str(d.pad_token_id))),
                                  pad_token=str(d.pad_token_id), eos_token=str(d.eos_token_id))

    rows = []
    for i in order:
        c, cm, r, rm = pairs[i]
        n_prompt = cm.index(True)
        rows.append({"prompt_ids": c[:n_prompt], "chosen_ids": c[n_prompt:], "rejected_ids": r[n_prompt:]})
    ds = datasets.Dataset.from_list(rows)

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    o = cfg.optim
    args = DPOConfig(
        output_dir=str(out / "trl"), loss_type="sigmoid_norm", beta=cfg.dpo.beta, label_smoothing=0.0,
        learning_rate=o.lr, lr_scheduler_type="linear" if o.schedule.name == "hf_linear" else "constant",
        warmup_steps=o.schedule.warmup if o.schedule.name == "hf_linear" else 0, adam_beta1=o.beta1, adam_beta2=o.beta2,
        adam_epsilon=o.eps, weight_decay=o.weight_decay, optim="adamw_torch", max_grad_norm=0.0,
        per_device_train_batch_size=cfg.train.global_batch_size, gradient_accumulation_steps=1,
        max_steps=cfg.train.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        seed=cfg.train.seed, data_seed=cfg.train.seed, bf16=False, fp16=False, max_length=None,
        precompute_ref_log_probs=False, train_sampling_strategy="sequential", dataloader_num_workers=0,
        disable_tqdm=True, dataset_num_proc=None, num_train_epochs=1, gradient_checkpointing=False,
    )
    kw = dict(torch_dtype=torch.float32, attn_implementation="eager")
    model = Olmo3ForCausalLM.from_pretrained(str(policy), **kw)
    ref = Olmo3ForCausalLM.from_pretrained(str(reference), **kw)
    # TRL logs beta * (summed log-ratio) as rewards/*; the length-normalised rewards its sigmoid_norm
    # loss is made of (beta * summed log-ratio / completion tokens) are rebuilt, in float64, from the
    # per-token log-probs of TRL's own forward passes (hooks on the policy and the reference model).
    seen: dict[str, list] = {"policy": [], "reference": []}

    def recorder(name: str):
        def hook(module, args, kwargs, output):
            if kwargs.get("fused_lm_head") and module.training == (name == "policy"):
                mask = (kwargs["labels"][:, 1:] != -100).double()
                lp = output.log_probs[:, -mask.shape[1]:].detach().double() * mask
                seen[name].append((lp.sum(dim=1), mask.sum(dim=1)))
        return hook

    model.register_forward_hook(recorder("policy"), with_kwargs=True)
    ref.register_forward_hook(recorder("reference"), with_kwargs=True)
    trainer = PreTokenized(model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=tok)
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its log lines; stdout is the report
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    if len(seen["policy"]) != len(logs) or len(seen["reference"]) != len(logs):
        raise RuntimeError(f"TRL ran {len(seen['policy'])} policy and {len(seen['reference'])} reference forwards "
                           f"for {len(logs)} logged steps; expected one of each per step")
    beta = cfg.dpo.beta
    out_rows = []
    for h, (pi, n), (rf, _) in zip(logs, seen["policy"], seen["reference"]):
        norm = (beta * (pi - rf) / n.clamp(min=1.0)).view(2, -1)     # [chosen; rejected] x pairs
        out_rows.append({"step": int(h["step"]), "loss": float(h["loss"]), "grad_norm": float(h["grad_norm"]),
                         "lr": float(h["learning_rate"]), "summed_rewards_chosen": float(h["rewards/chosen"]),
                         "summed_rewards_rejected": float(h["rewards/rejected"]),
                         "rewards_chosen": float(norm[0].mean()), "rewards_rejected": float(norm[1].mean())})
    return out_rows


def run(steps: int = 20, seed: int = 0, overrides: list[str] | tuple[str, ...] = (), out: str | None = None
        ) -> dict[str, Any]:
    """Both trainings and the per-step comparison (the JSON report)."""
    require("verify", "torch", "transformers", "trl", "datasets")  # before olmax's side trains
    from olmax.data.chat import write_pairs
    from olmax.objectives.dpo import step_pairs
    t0 = time.perf_counter()
    cfg0 = parity_config(steps, seed, overrides)
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="olmax-verify-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    pairs = make_pairs(PAIRS, cfg0.model.vocab_size, cfg0.data.sequence_length, seed, cfg0.data.eos_token_id,
                       cfg0.data.pad_token_id)
    folder = write_pairs(root / "pairs", pairs)
    policy, reference = _hf_models(cfg0, root, seed)
    cfg = parity_config(steps, seed, [*overrides, f"data.preference_path={folder}", f"train.init_from=hf:{policy}",
                                      f"dpo.reference=hf:{reference}"])
    run_dir = root / "olmax_run"
    if run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)
    ox = _run_olmax(cfg, run_dir)
    t1 = time.perf_counter()
    B = cfg.train.global_batch_size
    order = [int(i) for s in range(steps) for i in step_pairs(len(pairs), cfg.data.seed, B, s)]
    tr = _run_trl(cfg, policy, reference, pairs, order, root)
    t2 = time.perf_counter()

    rows = []
    for t in tr:
        o = ox.get(t["step"])
        if o is None:
            continue
        row = {"step": t["step"],
               "olmax_loss": o["dpo/loss"], "trl_loss": t["loss"],
               "olmax_rewards_chosen": o["dpo/rewards/chosen"], "trl_rewards_chosen": t["rewards_chosen"],
               "olmax_rewards_rejected": o["dpo/rewards/rejected"], "trl_rewards_rejected": t["rewards_rejected"],
               "olmax_summed_rewards_chosen": o["dpo/summed_rewards/chosen"],
               "trl_summed_rewards_chosen": t["summed_rewards_chosen"],
               "olmax_summed_rewards_rejected": o["dpo/summed_rewards/rejected"],
               "trl_summed_rewards_rejected": t["summed_rewards_rejected"],
               "olmax_grad_norm": o["optim/total grad norm"], "trl_grad_norm": t["grad_norm"],
               "olmax_lr": o["optim/LR (group 0)"], "trl_lr": t["lr"]}
        row["abs_loss_diff"] = abs(row["olmax_loss"] - row["trl_loss"])
        row["abs_rewards_chosen_diff"] = abs(row["olmax_rewards_chosen"] - row["trl_rewards_chosen"])
        row["abs_rewards_rejected_diff"] = abs(row["olmax_rewards_rejected"] - row["trl_rewards_rejected"])
        # Summed rewards (what TRL logs): beta times the difference of two fp32 sums of tens of
        # log-probs near -6, so each side alone rounds at ~1e-5 absolute; reported, not judged.
        for side in ("chosen", "rejected"):
            a, b = row[f"olmax_summed_rewards_{side}"], row[f"trl_summed_rewards_{side}"]
            row[f"abs_summed_rewards_{side}_diff"] = abs(a - b)
        row["rel_lr_diff"] = abs(row["olmax_lr"] - row["trl_lr"]) / max(abs(row["trl_lr"]), 1e-30)
        row["rel_grad_norm_diff"] = abs(row["olmax_grad_norm"] - row["trl_grad_norm"]) / max(abs(row["trl_grad_norm"]),
                                                                                          1e-30)
        rows.append(row)

    def mx(key: str) -> float:
        return max((r[key] for r in rows), default=math.nan)

    report = {
        "steps": len(rows),
        "requested_steps": steps,
        "max_abs_loss_diff": mx("abs_loss_diff"),
        "max_abs_rewards_chosen_diff": mx("abs_rewards_chosen_diff"),
        "max_abs_rewards_rejected_diff": mx("abs_rewards_rejected_diff"),
        "max_rel_grad_norm_diff": mx("rel_grad_norm_diff"),
        "max_rel_lr_diff": mx("rel_lr_diff"),
        "max_abs_summed_rewards_diff": max(mx("abs_summed_rewards_chosen_diff"),
                                           mx("abs_summed_rewards_rejected_diff")),
        "tolerance": TOLERANCE,
        "loss_moved": (rows[0]["trl_loss"] - rows[-1]["trl_loss"]) if rows else None,
        "seconds": {"olmax": round(t1 - t0, 1), "trl": round(t2 - t1, 1)},
        "out": str(root),
        "rows": rows,
    }
    report["ok"] = bool(rows) and len(rows) == steps and all(
        r["abs_loss_diff"] <= TOLERANCE and r["abs_rewards_chosen_diff"] <= TOLERANCE
        and r["abs_rewards_rejected_diff"] <= TOLERANCE and r["rel_grad_norm_diff"] <= TOLERANCE
        and (r["rel_lr_diff"] <= TOLERANCE or r["trl_lr"] == r["olmax_lr"]) for r in rows)
    return report


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"{'step':>4} {'loss olmax':>12} {'loss trl':>12} {'|dloss|':>9} {'|dr_c|':>9} {'|dr_r|':>9} "
             f"{'grad norm':>10} {'rel dnorm':>9}"]
    for r in rep["rows"]:
        lines.append(f"{r['step']:>4} {r['olmax_loss']:>12.8f} {r['trl_loss']:>12.8f} {r['abs_loss_diff']:>9.2e} "
                     f"{r['abs_rewards_chosen_diff']:>9.2e} {r['abs_rewards_rejected_diff']:>9.2e} "
                     f"{r['trl_grad_norm']:>10.5f} {r['rel_grad_norm_diff']:>9.2e}")
    verdict = "PASS" if rep["ok"] else "FAIL"
    lines.append(f"{verdict}: {rep['steps']} steps; max |dloss| {rep['max_abs_loss_diff']:.2e}, max |d rewards| "
                 f"{max(rep['max_abs_rewards_chosen_diff'], rep['max_abs_rewards_rejected_diff']):.2e}, max rel "
                 f"d grad norm {rep['max_rel_grad_norm_diff']:.2e} (tolerance {rep['tolerance']:g}); files in "
                 f"{rep['out']}")
    return "\n".join(lines)


def register(vs: argparse._SubParsersAction) -> None:
    p = vs.add_parser("trl", help="DPO (--dpo) or GRPO (--grpo) training parity with TRL 1.16's trainers")
    p.add_argument("--dpo", action="store_true", required=True, help="check DPO (the only check so far)")
    p.add_argument("--steps", type=positive_int, default=20, help="updates compared (default 20)")
    p.add_argument("--seed", type=seed_flag, default=0, help="seed of the model and data (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the parity config (e.g. optim.lr=1e-3)")
    p.add_argument("--out", default=None, help="directory for the models, pairs and runs (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    rep = run(args.steps, args.seed, args.overrides, args.out)
    print(jsonout.dumps(rep, indent=2) if args.json else format_report(rep))
    sys.stdout.flush()
    return 0 if rep["ok"] else 1
