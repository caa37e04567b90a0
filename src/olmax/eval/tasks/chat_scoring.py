"""Scoring of the local chat-format tasks (``olmax_chat_*``): math-verify equivalence, as lm-eval's
``minerva_math`` scores its ``math_verify`` metric, and IFEval-style instruction checks.

The instruction checks are a small stand-in for IFEval's (whose lm-eval scorer needs ``langdetect``
and ``immutabledict``): each doc lists instructions as ``ID`` or ``ID:ARG`` strings, scored strictly
on the response as generated; ``prompt_level_strict_acc`` is 1 when all hold, and
``inst_level_strict_acc`` the share of instructions that hold over the whole task (IFEval's two
strict metrics)."""

from __future__ import annotations

import re
from typing import Any


def math_verify_results(doc: dict, results: list[str]) -> dict[str, int]:
    """1 when math-verify finds the response's final answer equivalent to the solution's."""
    from math_verify import parse, verify
    return {"math_verify": int(bool(verify(gold=parse(doc["solution"]), target=parse(results[0]))))}


def _check(instruction: str, text: str) -> bool:
    name, _, arg = instruction.partition(":")
    if name == "no_comma":
        return "," not in text
    if name == "lowercase":
        return text == text.lower()
    if name == "max_words":
        return len(re.findall(r"\w+", text)) <= int(arg)
    if name == "include":
        return arg.lower() in text.lower()
    raise ValueError(f"unknown instruction {instruction!r} (known: no_comma, lowercase, max_words:N, include:WORD)")


def instruction_results(doc: dict, results: list[str]) -> dict[str, Any]:
    held = [_check(i, results[0]) for i in doc["instructions"]]
    return {"prompt_level_strict_acc": int(all(held)), "inst_level_strict_acc": held}


def agg_inst_level_acc(items: list[list[bool]]) -> float:
    """Share of all instructions that hold, over every prompt (IFEval's aggregation)."""
    flat = [x for item in items for x in item]
    return sum(flat) / len(flat)
