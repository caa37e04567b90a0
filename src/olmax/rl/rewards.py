"""Verifiable rewards: named built-ins or a Python callable, scaled by a multiplier.

A reward function scores one completion against its gold answer: ``score(completion, gold) ->
float``. ``RewardFn(name, multiplier)`` wraps one and returns ``multiplier * score``; a verifier
that raises, returns a non-number, or runs past ``timeout_s`` scores 0, and the failure is
counted (``RewardFn.failures``, ``RewardFn.timeouts``) and logged once per kind to stderr. It
never stops the run.

Built-ins (``get_reward(name)``):

- ``math``: the answer is extracted from the completion as open-instruct's math verifier does for
  OLMo 3: the last ``\\boxed{...}`` (braces matched), else the Minerva line "Final Answer: The
  final answer is X", else the last ``$...$``; the extracted answer and the gold answer are parsed
  and compared for mathematical equivalence by ``math-verify`` (``parse`` / ``verify``). Score 1 or 0.
- ``exact_match``: 1 when the completion, stripped, equals the gold answer, stripped.
- ``format``: 1 when the completion holds an answer inside ``<answer>...</answer>`` (non-empty),
  0 otherwise (the gold answer is not used).
- ``module:function``: any importable callable with the same signature.

AI2's 7B runs used ``multiplier = 10`` (``verification_reward``) on a {0, 1} verifier score.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import math
import re
import sys
import threading
from collections.abc import Callable

from olmax.extras import require

Score = Callable[[str, str], float]


# --------------------------------------------------------------------------- answer extraction


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with nested braces matched."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


_FINAL = re.compile(r"Final Answer:\s*The final answer is\s*(.+?)(?:\.\s*I hope it is correct\.?|\n|$)",
                    re.IGNORECASE | re.DOTALL)
_DOLLARS = re.compile(r"\$\$?([^$]+?)\$\$?")


def extract_math_answer(text: str) -> str | None:
    """The answer of a math completion: the last ``\\boxed{}``, else the Minerva "Final Answer",
    else the last ``$...$``; None when there is none."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    m = _FINAL.findall(text)
    if m:
        ans = m[-1].strip()
        inner = _DOLLARS.fullmatch(ans)
        return (inner.group(1) if inner else ans).strip() or None
    d = _DOLLARS.findall(text)
    if d:
        return d[-1].strip() or None
    return None


# --------------------------------------------------------------------------- built-in scores


def math_score(completion: str, gold: str) -> float:
    """1.0 when the completion's extracted answer equals ``gold`` mathematically (math-verify)."""
    from math_verify import parse, verify
    # RewardFn times the call itself; math-verify's note that its own timeout is off is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    ans = extract_math_answer(completion)
    if ans is None:
        return 0.0
    wrap = (lambda s: s if "$" in s or "\\boxed" in s else f"${s}$")
    # math-verify's own timeouts use signal.alarm (main thread only): RewardFn times the call instead.
    gold_p = parse(wrap(str(gold)), parsing_timeout=None, raise_on_error=True)
    pred_p = parse(wrap(ans), parsing_timeout=None, raise_on_error=True)
    if not gold_p or not pred_p:
        return 0.0
    return 1.0 if verify(gold_p, pred_p, timeout_seconds=None, raise_on_error=True) else 0.0


def exact_match_score(completion: str, gold: str) -> float:
    return 1.0 if completion.strip() == str(gold).strip() else 0.0


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_score(completion: str, gold: str = "") -> float:
    """1.0 when the completion holds a non-empty ``<answer>...</answer>``."""
    return 1.0 if any(m.strip() for m in _ANSWER_TAG.findall(completion)) else 0.0


BUILTINS: dict[str, Score] = {"math": math_score, "exact_match": exact_match_score, "format": format_score}


def resolve(name: str) -> Score:
    """A built-in by name, or ``module:function`` imported."""
    if name == "math":  # checked here, when the reward is chosen: a failing score counts as 0, it does not stop RL
        require("rl", "math_verify")
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ValueError(f"rl.reward={name!r}: not a built-in ({', '.join(BUILTINS)}) nor module:function")
    mod, _, fn = name.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r}: cannot import ({e})") from None
    if not callable(obj):
        raise ValueError(f"reward {name!r}: {type(obj).__name__} is not callable")
    return obj


# --------------------------------------------------------------------------- the wrapper


class RewardFn:
    """``reward(completion, gold) = multiplier * score``; failures score 0 and are counted."""

    def __init__(self, name: str, multiplier: float = 1.0, timeout_s: float | None = 10.0,
                 log: Callable[[str], None] | None = None):
        if not math.isfinite(multiplier):
            raise ValueError(f"reward {name!r}: multiplier must be finite, got {multiplier}")
        self.name, self.multiplier, self.timeout_s = name, float(multiplier), timeout_s
        self.score = resolve(name)
        self.failures = 0      # exceptions and non-numeric / non-finite scores
        self.timeouts = 0
        self.calls = 0
        self._logged: set[str] = set()
        self._log = log or (lambda s: print(s, file=sys.stderr))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _note(self, kind: str, msg: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self._log(f"olmax: reward {self.name}: {msg} (scored 0; further {kind}s are counted, not logged)")

    def _run(self, completion: str, gold: str) -> float:
        if self.timeout_s is None:
            return self.score(completion, gold)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="olmax-reward")
        fut = self._pool.submit(self.score, completion, gold)
        # A verifier that never returns keeps its worker thread; the run goes on with a 0.
        return fut.result(timeout=self.timeout_s)

    def __call__(self, completion: str, gold: str) -> float:
        with self._lock:
            self.calls += 1
        try:
            s = self._run(completion, gold)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.timeouts += 1
            self._note("timeout", f"verifier ran past {self.timeout_s}s")
            return 0.0
        except Exception as e:  # noqa: BLE001 - a verifier failure never stops the run
            with self._lock:
                self.failures += 1
            self._note("failure", f"verifier raised {type(e).__name__}: {e}")
            return 0.0
        try:
            s = float(s)
        except (TypeError, ValueError):
            s = math.nan
        if not math.isfinite(s):
            with self._lock:
                self.failures += 1
            self._note("failure", "verifier returned a non-finite or non-numeric score")
            return 0.0
        return self.multiplier * s

    def batch(self, completions: list[str], golds: list[str]) -> list[float]:
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        return [self(c, g) for c, g in zip(completions, golds)]

    def stats(self) -> dict[str, int]:
        return {f"rewards/{self.name}/calls": self.calls, f"rewards/{self.name}/failures": self.failures,
                f"rewards/{self.name}/timeouts": self.timeouts}


def get_reward(name: str, multiplier: float = 1.0, timeout_s: float | None = 10.0) -> RewardFn:
    return RewardFn(name, multiplier, timeout_s)
