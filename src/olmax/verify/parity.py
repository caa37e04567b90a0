"""Logit parity against HF transformers' ``Olmo3ForCausalLM`` (``olmax parity``).

The reference is transformers' eager attention in fp32 (spec section 2: HF masks with the
dtype's minimum; compare against eager for tight parity). olmax runs in fp32 or bf16 compute on
the same tokens. Reported, over the real vocabulary (padded rows sliced off, and both softmaxes
taken over the real vocabulary only):

- max |logit difference|;
- per-token KL(HF || olmax), mean and max (float64 log-softmax of the fp32 logits);
- top-1 agreement and mean top-10 overlap;
- per-layer hidden-state differences and the first one beyond tolerance. HF's ``hidden_states``
  are (embedding, layer 0 .. layer n-2 outputs, *final norm* of layer n-1's output): transformers
  replaces the last entry with ``last_hidden_state``. We capture layer n-1's raw output with a
  forward hook and compare the final norm separately, so every olmax residual has its HF twin.

fp32 criteria: KL max <= 1e-7, top-1 agreement 100%, max |logit diff| <= 1e-4. In bf16
the numbers are reported against the published noise floor (KL about 1.5e-3), never as a pass.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from olmax import jsonout
from olmax.argtypes import positive_int
from olmax.argtypes import seed as seed_flag
from olmax.eval.kl import check_tokens, load_token_array, logit_metrics, random_tokens, summarize
from olmax.extras import require

FP32_CRITERIA = {"kl_max": 1e-7, "top1_agreement": 1.0, "max_abs_logit_diff": 1e-4}
BF16_NOISE_FLOOR_KL = 1.5e-3  # published reproduction: bf16, full 8192 context
# Hidden-state tolerance: max |diff| relative to the HF state's max |value|, per layer.
HIDDEN_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


# --------------------------------------------------------------------------- the two models


def hf_reference(hf_dir: str | os.PathLike, tokens: np.ndarray, position_ids: np.ndarray | None = None
                 ) -> dict[str, Any]:
    """Run transformers' Olmo3ForCausalLM (eager, fp32) -> logits [b, t, V] and named hidden states.
    ``position_ids`` that restart (packed documents) make transformers mask attention to each
    document (``masking_utils.find_packed_sequence_indices``: no attention mask, no cache)."""
    import torch
    from transformers import Olmo3ForCausalLM

    model = Olmo3ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    captured: dict[str, torch.Tensor] = {}
    last = model.model.layers[-1]
    hook = last.register_forward_hook(lambda mod, args, out: captured.__setitem__(
        "raw", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            pos = None if position_ids is None else torch.as_tensor(position_ids, dtype=torch.long)
            out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long), position_ids=pos,
                        output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    hs = [h.float().numpy() for h in out.hidden_states]
    n = model.config.num_hidden_layers
    assert len(hs) == n + 1, "transformers returns embedding + one state per layer"
    hidden = {"embedding": hs[0]}
    hidden.update({f"layer {i}": hs[i + 1] for i in range(n - 1)})
    hidden[f"layer {n - 1}"] = captured["raw"].float().numpy()
    hidden["final_norm"] = hs[n]  # transformers' last entry is after the final norm
    return {"logits": out.logits.float().numpy(), "hidden": hidden, "config": model.config.to_dict()}


def olmax_run(params: Any, model_cfg: Any, tokens: np.ndarray, documents: tuple | None = None) -> dict[str, Any]:
    """olmax forward -> logits [b, t, padded V] (fp32) and named hidden states (fp32 copies); with
    ``documents`` = ``(positions, segment_ids)``, packed documents (``olmo3.document_segments``)."""
    import jax
    import jax.numpy as jnp

    from olmax.model.layers import rms_norm
    from olmax.model.olmo3 import forward

    @jax.jit
    def run(p: Any, t: jax.Array, docs: Any) -> Any:
        pos, seg = docs if docs is not None else (None, None)
        logits, hidden = forward(p, t, model_cfg, positions=pos, segment_ids=seg, return_hidden=True)
        final = rms_norm(hidden[-1], p["final_norm"], model_cfg.norm_eps)
        return logits, hidden, final

    logits, hidden, final = run(params, jnp.asarray(tokens, dtype=jnp.int32), documents)
    named = {"embedding": np.asarray(hidden[0], np.float32)}
    named.update({f"layer {i}": np.asarray(h, np.float32) for i, h in enumerate(hidden[1:])})
    named["final_norm"] = np.asarray(final, np.float32)
    return {"logits": np.asarray(logits, np.float32), "hidden": named}


# --------------------------------------------------------------------------- metrics


def compare_logits(hf: np.ndarray, ox: np.ndarray) -> dict[str, Any]:
    """``olmax.eval.kl``'s metrics over [b, t, V] logits of one vocabulary (HF is the reference
    distribution), in float64, row by row: [t, V] float64 copies stay small at 100k vocab."""
    assert hf.shape == ox.shape, (hf.shape, ox.shape)
    rows = (logit_metrics(a.astype(np.float64), b.astype(np.float64), xp=np) for a, b in zip(hf, ox))
    return summarize(rows, hf.shape[0] * hf.shape[1])


def compare_hidden(hf: dict[str, np.ndarray], ox: dict[str, np.ndarray], tol: float) -> dict[str, Any]:
    """Per-state max |diff| and max |diff| / max |HF|; the first state whose relative error > tol."""
    layers, first = [], None
    for name, a in hf.items():
        b = ox[name]
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
        rel = diff / max(float(np.abs(a).max()), 1e-30)
        layers.append({"name": name, "max_abs_diff": diff, "rel_diff": rel})
        if first is None and rel > tol:
            first = name
    return {"hidden_tolerance": tol, "first_divergent": first, "hidden": layers}


# --------------------------------------------------------------------------- driver


def _olmax_weights(hf_dir: Path, checkpoint: str | os.PathLike | None) -> tuple[Any, Any]:
    """olmax's ``(params, config)``: from ``checkpoint``, which must be the model ``hf_dir`` holds, or
    converted from ``hf_dir`` in memory."""
    from olmax.compat.hf import ConversionError, config_from_hf, load_hf_params, read_hf_config
    from olmax.config import model_differences

    hf_cfg = config_from_hf(read_hf_config(hf_dir))  # rejects non-OLMo-3 checkpoints early
    if checkpoint is None:
        return load_hf_params(hf_dir)
    from olmax.checkpoint.load import load_params
    params, cfg = load_params(checkpoint)  # a weights dir, a run dir or RUN/checkpoints/N
    # HF files carry neither olmax's vocabulary padding nor the master-weight dtype.
    differ = model_differences(cfg.model, hf_cfg.model, ignore=frozenset({"padded_vocab_size", "param_dtype"}))
    if differ:
        f, a, b = differ[0]
        raise ConversionError(f"--checkpoint {checkpoint} and --hf {hf_dir} describe different models "
                              f"(model.{f}: {a!r} vs {b!r})")
    return params, cfg


def _parity_tokens(tokens: np.ndarray | str | os.PathLike | None, cfg: Any, batch: int, seq_len: int, seed: int,
                   document_masking: bool) -> np.ndarray:
    """The token rows, checked against the model: random (with EOS planted at random places for
    ``document_masking``), the given array, or loaded from a file."""
    from olmax.config import ConfigError

    vocab = cfg.model.vocab_size
    if tokens is None:
        toks = random_tokens(vocab, batch, seq_len, seed)
    elif isinstance(tokens, np.ndarray):
        toks = check_tokens(tokens, vocab)
    else:
        toks = load_token_array(str(tokens), vocab)
    if toks.shape[1] > cfg.model.max_position_embeddings:
        # transformers' eager path would first build a [batch, 1, t, t] fp32 mask (80 GB at 100,000
        # tokens) and fail in its allocator.
        raise ConfigError(f"--seq-len {toks.shape[1]} (or rows of --tokens that long): longer than the model's "
                          f"max_position_embeddings ({cfg.model.max_position_embeddings})")
    if document_masking and tokens is None:  # three to five documents a row, some shorter than a window
        eos = cfg.data.eos_token_id
        rng = np.random.default_rng(seed + 1)
        for row in toks:
            row[rng.choice(toks.shape[1] - 1, size=min(4, toks.shape[1] - 1), replace=False)] = eos
    return toks


def _check_runtime_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """Parity compares one model: ``overrides`` may change only how it is computed."""
    from olmax.config import RUNTIME_MODEL_FIELDS, ConfigError

    for o in overrides:
        key = o.split("=", 1)[0].strip()
        if not (key.startswith("model.") and key[len("model."):] in RUNTIME_MODEL_FIELDS - {"compute_dtype"}):
            raise ConfigError(f"parity --set {o!r}: only how the model is computed may change "
                              f"(model.{', model.'.join(sorted(RUNTIME_MODEL_FIELDS - {'compute_dtype'}))}); "
                              "use --dtype for the compute dtype")


def run_parity(hf_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
               tokens: np.ndarray | str | os.PathLike | None = None, seq_len: int = 128, batch: int = 2,
               dtype: str = "float32", seed: int = 0, dump: str | os.PathLike | None = None,
               hidden_tol: float | None = None, attention_impl: str | None = None,
               overrides: list[str] | tuple[str, ...] = (), document_masking: bool = False) -> dict[str, Any]:
    """Run HF (fp32 eager) and olmax on the same tokens and return the parity report (a dict).

    Weights for olmax come from ``checkpoint`` (an olmax weights directory) or are converted from
    ``hf_dir`` in memory. ``dtype`` is olmax's compute dtype; parameters keep their stored dtype.
    ``attention_impl`` defaults to the exact reference attention in fp32 and the config's choice
    (cuDNN on GPU) in bf16. ``overrides`` (``model.KEY=VALUE``) set how the model is computed
    (``RUNTIME_MODEL_FIELDS``: kernel block sizes, remat, scanned layers), never what it is.
    ``document_masking``: the tokens are packed documents ending at the config's EOS (random
    tokens get EOS planted at random places); olmax gets their positions and segment ids,
    transformers the same positions as ``position_ids``."""
    require("hf", "torch", "transformers")  # before olmax's side loads or converts the weights
    from olmax.compat.hf import ConversionError
    from olmax.config import validate

    if dtype not in HIDDEN_TOL:
        raise ConversionError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    hf_dir = Path(hf_dir)
    params, cfg = _olmax_weights(hf_dir, checkpoint)
    vocab = cfg.model.vocab_size
    toks = _parity_tokens(tokens, cfg, batch, seq_len, seed, document_masking)
    eos = cfg.data.eos_token_id if document_masking else None
    _check_runtime_overrides(overrides)
    cfg = validate(cfg.override(list(overrides)))
    from olmax.model.dispatch import resolve_attention
    impl = resolve_attention(attention_impl or ("reference" if dtype == "float32" else cfg.model.attention_impl), dtype)
    model_cfg = replace(cfg.model, compute_dtype=dtype, attention_impl=impl)

    docs = None
    if document_masking:
        from olmax.model.olmo3 import document_segments
        docs = tuple(np.array(a) for a in document_segments(np.asarray(toks), eos))
    ref = hf_reference(hf_dir, toks, None if docs is None else docs[0])
    ox = olmax_run(params, model_cfg, toks, docs)
    hf_logits, ox_logits = ref["logits"], ox["logits"][..., :vocab]
    report: dict[str, Any] = {
        "hf_dir": str(hf_dir), "checkpoint": None if checkpoint is None else str(checkpoint),
        "dtype": dtype, "reference": "transformers Olmo3ForCausalLM, eager attention, float32",
        "attention_impl": impl, "batch": int(toks.shape[0]), "seq_len": int(toks.shape[1]),
        "document_masking": document_masking,
        "documents": int((toks[:, :-1] == eos).sum() + toks.shape[0]) if document_masking else int(toks.shape[0]),
        "vocab_size": vocab, "padded_vocab_size": cfg.model.embedding_rows,
    }
    report.update(compare_logits(hf_logits, ox_logits))
    report.update(compare_hidden(ref["hidden"], ox["hidden"], HIDDEN_TOL[dtype] if hidden_tol is None else hidden_tol))
    if dtype == "float32":
        report["criteria"] = FP32_CRITERIA
        report["pass"] = bool(report["kl_max"] <= FP32_CRITERIA["kl_max"]
                              and report["top1_agreement"] >= FP32_CRITERIA["top1_agreement"]
                              and report["max_abs_logit_diff"] <= FP32_CRITERIA["max_abs_logit_diff"])
    else:
        report["noise_floor_kl"] = BF16_NOISE_FLOOR_KL  # published bf16 noise floor; not a pass/fail test
    if dump is not None:
        np.savez(dump, hf=hf_logits, olmax=ox_logits, tokens=toks)
        report["dump"] = str(dump)
    return report


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"parity: olmax ({r['dtype']} compute, {r['attention_impl']} attention) vs {r['reference']}",
        f"  tokens: {r['batch']} x {r['seq_len']} = {r['tokens']}   vocab {r['vocab_size']} "
        f"(olmax rows {r['padded_vocab_size']}, padded rows sliced off)",
        (f"  packed documents: {r['documents']} (masked to each document, positions restart)"
         if r.get("document_masking") else ""),
        f"  max |logit diff|:    {r['max_abs_logit_diff']:.3e}",
        f"  KL(HF || olmax):     mean {r['kl_mean']:.3e}   max {r['kl_max']:.3e}",
        f"  top-1 agreement:     {100 * r['top1_agreement']:.2f}%",
        f"  top-10 overlap:      {100 * r['top10_overlap']:.2f}%",
        f"  first divergent hidden state (rel > {r['hidden_tolerance']:g}): {r['first_divergent'] or 'none'}",
    ]
    worst = max(r["hidden"], key=lambda h: h["rel_diff"])
    lines.append(f"  worst hidden state:  {worst['name']} (max |diff| {worst['max_abs_diff']:.3e}, "
                 f"rel {worst['rel_diff']:.3e})")
    if "pass" in r:
        c = r["criteria"]
        lines.append(f"  fp32 criteria (KL max <= {c['kl_max']:g}, top-1 100%, max |diff| <= "
                     f"{c['max_abs_logit_diff']:g}): {'PASS' if r['pass'] else 'FAIL'}")
    else:
        lines.append(f"  (bf16: reported only; the published bf16 noise floor is KL about {r['noise_floor_kl']:g})")
    if r.get("dump"):
        lines.append(f"  logits written to {r['dump']}")
    return "\n".join(x for x in lines if x)


def _cmd(args: argparse.Namespace) -> int:
    r = run_parity(args.hf, checkpoint=args.checkpoint, tokens=args.tokens, seq_len=args.seq_len, batch=args.batch_size,
                   dtype=args.dtype, seed=args.seed, dump=args.dump, attention_impl=args.attention,
                   overrides=args.overrides, document_masking=args.document_masking)
    print(jsonout.dumps(r, indent=2) if args.json else format_report(r))
    # A failed fp32 parity is a failed command (scripts and CI can rely on the exit code).
    return 0 if r.get("pass", True) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``olmax parity``; sets ``func(args) -> int``."""
    p = subparsers.add_parser("parity", help="logit parity of olmax against transformers' Olmo3ForCausalLM")
    p.add_argument("--hf", required=True, help="HF model directory (the fp32 eager reference)")
    p.add_argument("--checkpoint", default=None,
                   help="olmax weights directory, run directory or RUN/checkpoints/N (default: convert --hf in memory)")
    p.add_argument("--tokens", default=None, help=".npy array of token ids [T] or [B, T] (default: random)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence compared (default 128)")
    p.add_argument("--batch-size", type=positive_int, default=2, help="sequences of random tokens (default 2)")
    p.add_argument("--batch", dest="batch_size", type=positive_int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old spelling, kept until the next release
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="olmax compute dtype")
    p.add_argument("--attention", default=None,
                   choices=["auto", "reference", "blocked", "cpu", "splash", "cudnn", "xla"],
                   help="attention kernel (default: reference in fp32, the config's choice in bf16; splash "
                        "runs in Pallas interpret mode off TPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="model.KEY=VALUE",
                   help="how the model is computed, e.g. --set model.attention_block_q=128 (repeatable)")
    p.add_argument("--seed", type=seed_flag, default=0, help="seed of the random tokens")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--document-masking", action="store_true",
                   help="treat the tokens as packed documents ending at EOS: attention stays within a document and "
                        "positions restart (data.document_masking); transformers gets the same position_ids")
    p.add_argument("--dump", default=None, metavar="FILE.npz", help="write hf/olmax logits and tokens")
    p.set_defaults(func=_cmd)

