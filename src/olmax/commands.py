"""Core subcommands: print-config, inspect."""

from __future__ import annotations

import argparse

import jax

from olmax import jsonout
from olmax.argtypes import positive_float, positive_int
from olmax.compile import memory_verdict, parse_topology
from olmax.metrics.flops import flops_per_token
from olmax.metrics.memory import memory_estimate
from olmax.model.params import count_params
from olmax.recipes import add_recipe_args, get_recipe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("print-config", help="print the resolved config as YAML")
    add_recipe_args(p)
    p.set_defaults(func=cmd_print_config)

    p = sub.add_parser("inspect", help="parameter counts, FLOPs per token and per-device memory, without allocating")
    add_recipe_args(p)
    p.add_argument("--devices", type=positive_int, default=None,
                   help="global device count for the memory estimate (default: the devices JAX sees)")
    p.add_argument("--topology", default=None,
                   help="a TPU slice (v5p-128, v6e-256, ...): its device count and HBM give a fits / "
                        "does not fit verdict")
    p.add_argument("--hbm-gib", type=positive_float, default=None,
                   help="memory per device for the verdict (e.g. 80 for an H100)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    p.set_defaults(func=cmd_inspect)


def cmd_print_config(args: argparse.Namespace) -> int:
    print(get_recipe(args.recipe, args.overrides).to_yaml(), end="")
    return 0


def inspect_config(cfg, n_devices: int) -> dict:
    m = cfg.model
    padded = count_params(m, padded=True)
    unpadded = count_params(m, padded=False)
    L = cfg.data.sequence_length
    fl = flops_per_token(m, L)
    tokens_per_step = cfg.train.global_batch_size * L
    return {
        "recipe": cfg.name,
        "params": {"total": unpadded["total"], "total_padded": padded["total"],
                   "non_embedding": padded["non_embedding"], "embedding_padded": padded["embedding"]},
        "layers": {"full_attention": [i for i in range(m.n_layers) if m.is_full_attention(i)],
                   "sliding_window": m.sliding_window},
        "flops_per_token": fl,
        "tokens_per_step": tokens_per_step,
        "flops_per_step": fl["total"] * tokens_per_step,
        "devices": n_devices,
        "memory_per_device": memory_estimate(cfg, n_devices),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    cfg = get_recipe(args.recipe, args.overrides)
    hbm = args.hbm_gib
    n = args.devices
    if args.topology:
        topo = parse_topology(args.topology)
        n = n or topo.devices
        hbm = hbm or topo.family.hbm_gib
    n = n or jax.device_count()
    info = inspect_config(cfg, n)
    if hbm is not None:
        need = info["memory_per_device"]["total_gib"]
        v = memory_verdict(need, hbm)
        info.update(hbm_gib=hbm, fits=v["fits"], verdict=v["verdict"] + " (estimate)")
    if args.json:
        print(jsonout.dumps(info, indent=2))
        return 0
    p, f, mem = info["params"], info["flops_per_token"], info["memory_per_device"]
    print(f"recipe            {info['recipe']}")
    print(f"parameters        {p['total']:,} (vocab {cfg.model.vocab_size}); {p['total_padded']:,} padded "
          f"to {cfg.model.embedding_rows}")
    print(f"non-embedding     {p['non_embedding']:,} (LM head included)")
    print(f"full-attn layers  {info['layers']['full_attention']} (others: window {info['layers']['sliding_window']})")
    print(f"FLOPs/token       {f['total']:.4e} (dense {f['dense']:.4e} + attention {f['attention']:.4e}) "
          f"at seq {cfg.data.sequence_length}")
    print(f"FLOPs/step        {info['flops_per_step']:.4e} ({info['tokens_per_step']:,} tokens)")
    print(f"memory/device     {mem['total_gib']:.2f} GiB on {n} devices: weights {mem['weights_gib']:.2f}, "
          f"grads {mem['grads_gib']:.2f}, Adam {mem['adam_moments_gib']:.2f}, "
          f"activations {mem['activations_gib']:.2f}, "
          f"layer workspace {mem['layer_workspace_gib']:.2f}, logits {mem['logits_gib']:.2f}, "
          f"attention scores {mem['attention_scores_gib']:.2f}")
    if "verdict" in info:
        print(f"verdict           {info['verdict']} of {info['hbm_gib']:.2f} GiB per device; "
              "`olmax compile` gives XLA's exact figure for a TPU slice")
    return 0
