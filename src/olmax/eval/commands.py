"""``olmax eval {loss,domains,kl,lm-eval}`` and ``olmax compare``.

Checkpoints are anything ``olmax.checkpoint.load.load_params`` reads: an olmax weights directory, a
run directory (newest checkpoint), ``RUN/checkpoints/N``, or ``hf:DIR``. Token files are raw
arrays (no header) or folders / ``manifest.json`` from ``olmax tokenize``.

JSON (``--json``; stable keys):

- ``eval loss``: ``{"checkpoint", "files", "seq_len", "batch_size", "batches", "tokens", "loss",
  "perplexity", "loss_se", "per_batch_loss"}``; loss in nats/token (``olmax.eval.heldout``'s rule,
  as ``eval domains``), ``loss_se`` the standard error over batches (null for one batch).
- ``eval domains``: ``{"checkpoint", "domains": {NAME: {...}}, "macro", "micro", "seq_len",
  "batch_size", "batches"}`` (keys in ``olmax.eval.domains``).
- ``eval kl``: ``{"a", "b", "inputs", "batch", "seq_len", "kl_mean", "kl_max", "top1_agreement",
  "top10_overlap", "max_abs_logit_diff", "tokens"}`` (``olmax.eval.kl``).
- ``compare``: the summary of ``olmax.eval.compare`` (also written to ``OUT/summary.json``).

On an error with ``--json`` the CLI prints ``{"error": msg}`` and exits 2. The commands import
their implementation when they run (the CLI starts without Orbax, Optax or lm-eval).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from olmax import jsonout
from olmax.argtypes import TOKEN_DTYPES, nonneg_int, positive_int
from olmax.argtypes import seed as seed_flag
from olmax.eval import suite
from olmax.eval.alarm import AlarmConfig


def register(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="held-out loss, multi-domain perplexity, KL between checkpoints")
    esub = ev.add_subparsers(dest="eval_command", metavar="EVAL")
    esub.required = True

    p = esub.add_parser("loss", help="held-out loss on fixed batches of token files")
    _checkpoint_args(p)
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="held-out token files (or tokenize folders / manifest.json)")
    _window_args(p)
    p.set_defaults(func=cmd_loss)

    p = esub.add_parser("domains", help="Paloma-style loss, perplexity and bits per byte per domain")
    _checkpoint_args(p)
    p.add_argument("--domain", action="append", required=True, metavar="SPEC",
                   help="NAME=PATH[,PATH...]:BYTES (raw UTF-8 bytes of the text), or a YAML file "
                        "{NAME: {paths: [...], bytes: N}} (repeatable)")
    _window_args(p, batches_help="batches per domain (default eval.batches of the checkpoint; 0 = all)",
                 all_batches=True)
    p.set_defaults(func=cmd_domains)

    p = esub.add_parser("kl", help="token-level KL(A || B), top-1/top-10 agreement on identical inputs")
    p.add_argument("a", help="model A (the reference distribution): weights/run/checkpoint dir or hf:DIR")
    p.add_argument("b", help="model B")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tokens", default=None, metavar="FILE.npy",
                     help="token ids saved with numpy.save, [T] or [B, T]")
    src.add_argument("--data", nargs="+", default=None, metavar="FILE",
                     help="raw token files: the first --batch-size windows")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence compared (default 128)")
    p.add_argument("--batch-size", type=positive_int, default=2, help="windows (default 2)")
    p.add_argument("--batch", dest="batch_size", type=positive_int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old spelling, kept until the next release
    p.add_argument("--seed", type=seed_flag, default=0, help="seed of the random tokens (without --tokens/--data)")
    p.add_argument("--token-dtype", choices=TOKEN_DTYPES, default=None,
                   help="dtype of --data files (default: A's data.dtype)")
    _dtype_arg(p, "cast both models' weights (default: as stored)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    p.set_defaults(func=cmd_kl)

    suite.register(esub)

    d = AlarmConfig()
    p = sub.add_parser("compare", help="compare runs (and a reference curve): plots, milestones, memorisation alarm")
    p.add_argument("inputs", nargs="+", metavar="RUN_OR_FILE",
                   help="run directories, metrics.jsonl, step/loss TSV or exported W&B CSV files")
    p.add_argument("--reference", default=None, metavar="FILE", help="reference curve (any input format)")
    p.add_argument("--reference-label", default="reference", help="the reference curve's name in the report")
    p.add_argument("--labels", nargs="+", default=None, help="one label per input")
    p.add_argument("--out", default="compare-report", metavar="DIR", help="output folder (default: compare-report)")
    p.add_argument("--bins", type=positive_int, default=50, help="step bins of the gap panel (default 50)")
    p.add_argument("--smooth", type=positive_int, default=5, help="bins in the gap's moving average (default 5)")
    p.add_argument("--threshold", type=float, default=d.threshold,
                   help=f"alarm: train gap below -T nats counts as improvement (default {d.threshold})")
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction,
                   help="alarm: held-out must keep this share of the train gain (default %(default)s)")
    p.add_argument("--window", type=positive_int, default=None,
                   help="alarm/milestone window in steps (default: bin width)")
    p.add_argument("--heldout-metric", default=None,
                   help="held-out metric for the alarm (default eval/heldout/CE loss)")
    p.add_argument("--fail-on-alarm", action="store_true", help="exit 1 when the memorisation alarm fires")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    p.set_defaults(func=cmd_compare)


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="weights/run/checkpoint dir or hf:DIR")
    _dtype_arg(p, "cast the weights (default: as stored)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")


def _dtype_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``--dtype``, as convert, parity and lm-eval spell it."""
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help=help)
    p.add_argument("--param-dtype", dest="dtype", choices=["float32", "bfloat16"], default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old spelling, kept until the next release


def _window_args(p: argparse.ArgumentParser, batches_help: str = "batches (default eval.batches of the checkpoint)",
                 all_batches: bool = False) -> None:
    """``all_batches``: ``--batches 0`` means every whole batch."""
    p.add_argument("--seq-len", type=positive_int, default=None, help="window length (default data.sequence_length)")
    p.add_argument("--batches", type=nonneg_int if all_batches else positive_int, default=None, help=batches_help)
    p.add_argument("--batch-size", type=positive_int, default=None, help="windows per batch (default eval.batch_size)")
    p.add_argument("--token-dtype", choices=TOKEN_DTYPES, default=None,
                   help="token file dtype (default data.dtype of the checkpoint)")


def _load(path: str, dtype: str | None) -> tuple[Any, Any]:
    from olmax.checkpoint.load import load_params
    return load_params(path, dtype=dtype)


def cmd_loss(args: argparse.Namespace) -> int:
    from olmax.eval.heldout import HeldoutEvaluator
    params, cfg = _load(args.checkpoint, args.dtype)
    ev = HeldoutEvaluator(cfg, paths=args.data, seq_len=args.seq_len, batch_size=args.batch_size,
                          batches=args.batches, dtype=args.token_dtype)
    r = ev.evaluate_detailed(params)
    out = {"checkpoint": args.checkpoint, "files": ev.files[""], "seq_len": ev.seq_len, "batch_size": ev.batch_size,
           "batches": r["batches"], "tokens": r["tokens"], "loss": r["loss"], "perplexity": r["perplexity"],
           "loss_se": r["loss_se"], "per_batch_loss": r["per_batch_loss"]}
    if args.json:
        print(jsonout.dumps(out, indent=2))
    else:
        se = "" if r["loss_se"] is None else f" +- {r['loss_se']:.4f} (SE over batches)"
        print(f"held-out loss {r['loss']:.4f}{se} nats/token, perplexity {r['perplexity']:.3f} "
              f"({r['tokens']:,} labels in {r['batches']} batches of {ev.batch_size} x {ev.seq_len})")
    return 0


def cmd_domains(args: argparse.Namespace) -> int:
    from olmax.eval.domains import DomainEvaluator, load_domains
    domains = load_domains(args.domain)
    params, cfg = _load(args.checkpoint, args.dtype)
    ev = DomainEvaluator(cfg, domains, seq_len=args.seq_len, batch_size=args.batch_size, batches=args.batches,
                         dtype=args.token_dtype)
    r = {"checkpoint": args.checkpoint, **ev.evaluate_detailed(params)}
    if args.json:
        print(jsonout.dumps(r, indent=2))
        return 0
    w = max(8, *(len(n) for n in r["domains"]))
    print(f"{'domain':<{w}}  {'loss':>8}  {'ppl':>10}  {'bits/byte':>9}  {'tokens':>10}")
    for name, m in [*r["domains"].items(), ("macro", r["macro"]), ("micro", r["micro"])]:
        toks = f"{m['tokens_scored']:>10,}" if "tokens_scored" in m else f"{'':>10}"
        print(f"{name:<{w}}  {m['loss']:>8.4f}  {m['perplexity']:>10.3f}  {m['bits_per_byte']:>9.4f}  {toks}")
    return 0


def cmd_kl(args: argparse.Namespace) -> int:
    from olmax.eval.kl import kl, load_token_array, random_tokens
    pa, ca = _load(args.a, args.dtype)
    pb, cb = _load(args.b, args.dtype)
    vocab = ca.model.vocab_size
    if args.tokens:
        toks, inputs = load_token_array(args.tokens, vocab), args.tokens
    elif args.data:
        from olmax.data.dataset import resolve_paths
        from olmax.eval.heldout import heldout_windows
        dt = args.token_dtype or ca.data.dtype
        files = [f for f, _ in resolve_paths(list(args.data), dtype=dt)]
        toks, inputs = heldout_windows(files, dt, args.seq_len, args.batch_size), ", ".join(files)
    else:
        toks, inputs = random_tokens(vocab, args.batch_size, args.seq_len, args.seed), f"random seed {args.seed}"
    r = kl(pa, ca, pb, cb, toks)
    out = {"a": args.a, "b": args.b, "inputs": inputs, "batch": int(toks.shape[0]), "seq_len": int(toks.shape[-1]), **r}
    if args.json:
        print(jsonout.dumps(out, indent=2))
    else:
        print(f"KL({args.a} || {args.b}) on {r['tokens']:,} tokens ({inputs})")
        print(f"  KL mean {r['kl_mean']:.3e}  max {r['kl_max']:.3e} nats")
        print(f"  top-1 agreement {100 * r['top1_agreement']:.2f}%  top-10 overlap {100 * r['top10_overlap']:.2f}%")
        print(f"  max |logit diff| {r['max_abs_logit_diff']:.3e}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from olmax.eval.compare import compare
    s = compare(args.inputs, args.reference, labels=args.labels, out=args.out, bins=args.bins, smooth=args.smooth,
                alarm=AlarmConfig(args.threshold, args.heldout_fraction, args.window),
                heldout_metric=args.heldout_metric, reference_label=args.reference_label)
    fired = any(a["fired"] for a in s["alarms"].values())
    if args.json:
        print(jsonout.dumps(s, indent=2))
    else:
        for label, g in s["gaps"].items():
            mean = "n/a" if g["mean"] is None else f"{g['mean']:+.4f}"
            print(f"{label} vs {s['baseline']}: mean gap {mean} nats over {g['points']} aligned steps")
        print(f"report: {s['files']['report_html']} (and report.md, loss.png, gap.png, summary.json)")
    for a in s["alarms"].values():
        # Loud on stderr even with --json, so a script's log shows it.
        if a["fired"] or a["status"] == "unverified":
            print(a["message"], file=sys.stderr)
    return 1 if (fired and args.fail_on_alarm) else 0
