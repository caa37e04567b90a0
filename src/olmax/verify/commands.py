"""``olmax verify {resume,olmo-core}``."""

from __future__ import annotations

import argparse

from olmax import jsonout
from olmax.verify import noise_floor, olmo_core, resume, trl, trl_grpo


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove equivalences: resume A/B, parity with OLMo-core and TRL")
    vs = p.add_subparsers(dest="verify_command", metavar="CHECK")
    vs.required = True
    resume.register(vs)
    olmo_core.register(vs, func=_olmo_core)
    trl.register(vs)
    trl_grpo.attach(vs)   # --grpo beside trl's --dpo


def _olmo_core(args: argparse.Namespace) -> int:
    """``olmax verify olmo-core``: the fixed-tolerance parity, or with ``--noise-floor`` the verdict
    against OLMo-core's own noise."""
    if not args.noise_floor:
        return olmo_core._main(args)
    factor = noise_floor.NOISE_FACTOR if args.noise_factor is None else args.noise_factor
    # OLMo-core's SFT loss is each rank's token mean, averaged over ranks: olmax's train.loss_ranks.
    overrides = ([*olmo_core.SFT_OVERRIDES, f"train.loss_ranks={args.ranks}", *args.overrides] if args.sft
                 else args.overrides)
    report = noise_floor.run_noise_floor(args.steps, args.seed, overrides, args.olmax_overrides, args.out,
                                         factor=factor, world=args.ranks, with_plots=args.plots)
    print(jsonout.dumps(report, indent=2) if args.json else noise_floor.format_report(report))
    return 0 if report["within_noise"] else 1
