"""``olmax verify {resume,olmo-core}``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove equivalences: resume A/B, parity with OLMo-core")
    vs = p.add_subparsers(dest="verify_command", metavar="CHECK")
    vs.required = True
    from olmax.verify import olmo_core, resume
    resume.register(vs)
    olmo_core.register(vs)
